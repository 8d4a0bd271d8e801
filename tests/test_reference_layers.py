"""Every unit case of ../shared/reference (outputs of real BVLC Caffe), layer by layer, to 1e-4."""
import pytest
from refcase import list_cases, max_rel_err, reference_available, run_case_layerwise

pytestmark = pytest.mark.skipif(not reference_available(), reason="../shared/reference not present")

UNIT_CASES = list_cases("unit") if reference_available() else []


@pytest.mark.parametrize("case", UNIT_CASES)
def test_unit_case_matches_caffe(case):
    results = run_case_layerwise(case)
    assert results, f"{case}: nothing compared"
    for what, ours, theirs in results:
        err = max_rel_err(ours, theirs)
        assert err <= 1e-4, f"{case}: {what} differs from Caffe by {err:.3g} (relative to its max)"


# -- cases-added.json: BVLC master fields (PoolingParameter.round_mode, InfogainLossParameter.axis) --
ROUND_MODE_AXIS_CASES = ["pool_max_round_floor", "pool_ave_round_floor", "infogain_axis2"]


@pytest.mark.parametrize("case", ROUND_MODE_AXIS_CASES)
def test_bvlc_master_field_case_matches_caffe(case):
    results = run_case_layerwise(case)
    whats = {what for what, _, _ in results}
    assert "data/" + ("loss" if case.startswith("infogain") else "y") in whats
    assert any(w.startswith("diff/") for w in whats), f"{case}: no gradient compared"
    for what, ours, theirs in results:
        err = max_rel_err(ours, theirs)
        assert err <= 1e-4, f"{case}: {what} differs from Caffe by {err:.3g} (relative to its max)"


# ---- cases added for issue 13's new layers (LSTM, RNN, LSTMUnit, SPP); indexed in cases-added.json ----
ADDED_LAYER_CASES = ["lstm_t3_n2", "lstmunit", "rnn_t3_n2", "spp_max_h2"]


@pytest.mark.parametrize("case", ADDED_LAYER_CASES)
def test_added_layer_case_matches_caffe(case):
    results = run_case_layerwise(case)
    compared = {what.split("/")[0] for what, _, _ in results}
    assert {"data", "diff"} <= compared, f"{case}: forward and backward not both compared"
    for what, ours, theirs in results:
        err = max_rel_err(ours, theirs)
        assert err <= 1e-4, f"{case}: {what} differs from Caffe by {err:.3g} (relative to its max)"
