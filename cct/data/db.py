"""Caffe's key-value databases: read-only cursors (LMDB, LevelDB) and writers for the tools.

Values are serialized ``Datum`` records; keys are whatever the writer chose (the Caffe tools use
zero-padded indices such as ``"%08d"`` so that the lexicographic key order is the insertion order).

* LMDB through py-lmdb (opened ``readonly=True, lock=False``: many readers, no lock file needed).
* LevelDB through plyvel, when installed (``pip install cct[leveldb]``).

A cursor behaves like Caffe's ``db::Cursor``: ``seek_to_first()``, ``next()``, ``valid``, ``key``,
``value``. ``parse_datum`` turns a value into a ``Datum`` and names the key when it cannot.
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import CctError
from ..proto import caffe_pb2

log = logging.getLogger("cct")

_BACKEND_NAMES = {"lmdb": "lmdb", "leveldb": "leveldb"}


def backend_name(backend: str | int) -> str:
    """Normalize a backend given as a name ('lmdb', 'LEVELDB') or a ``DataParameter.DB`` enum value."""
    if isinstance(backend, int):
        if backend == caffe_pb2.DataParameter.LMDB:
            return "lmdb"
        if backend == caffe_pb2.DataParameter.LEVELDB:
            return "leveldb"
        raise CctError(f"unknown database backend {backend}")
    name = _BACKEND_NAMES.get(str(backend).lower())
    if name is None:
        raise CctError(f"unknown database backend '{backend}' (expected lmdb or leveldb)")
    return name


def _import_plyvel(path: str):
    try:
        import plyvel  # type: ignore
    except ImportError:
        hint = ""
        if os.path.isfile(os.path.join(path, "data.mdb")):
            hint = f" ('{path}' looks like an LMDB: set backend: LMDB / --backend lmdb)"
        raise CctError(
            f"LevelDB database '{path}' needs the plyvel package: pip install cct[leveldb]{hint}"
        ) from None
    return plyvel


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------
class Cursor:
    """Caffe's ``db::Cursor``: a position in a database, in key order."""

    path: str

    @property
    def valid(self) -> bool:  # pragma: no cover - interface
        raise NotImplementedError

    def seek_to_first(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def next(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    @property
    def key(self) -> bytes:  # pragma: no cover - interface
        raise NotImplementedError

    @property
    def value(self) -> bytes:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> None:
        """Release the cursor."""


class DB:
    """A read-only database: ``len(db)``, ``db.cursor()``, ``db.items()``, ``db.close()``."""

    path: str
    backend: str

    def cursor(self) -> Cursor:  # pragma: no cover - interface
        raise NotImplementedError

    def __len__(self) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def is_empty(self) -> bool:
        """True when the database holds no record."""
        return len(self) == 0

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        """Every (key, value) in key order."""
        cur = self.cursor()
        try:
            while cur.valid:
                yield cur.key, cur.value
                cur.next()
        finally:
            cur.close()

    def __enter__(self) -> DB:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LMDBCursor(Cursor):
    """Cursor over an LMDB (one long read transaction; py-lmdb sets MDB_NOTLS, so any thread may use it)."""

    def __init__(self, env, path: str):
        self.path = path
        self._txn = env.begin(write=False, buffers=False)
        self._cur = self._txn.cursor()
        self._valid = self._cur.first()

    @property
    def valid(self) -> bool:
        return self._valid

    def seek_to_first(self) -> None:
        self._valid = self._cur.first()

    def next(self) -> None:
        self._valid = self._cur.next()

    @property
    def key(self) -> bytes:
        return self._cur.key()

    @property
    def value(self) -> bytes:
        return self._cur.value()

    def close(self) -> None:
        if self._txn is not None:
            self._cur.close()
            self._txn.abort()
            self._txn = None


class OpenDatabases:
    """The databases open for reading in this process, each shared by its readers and closed with the last.

    Per process because the libraries allow one handle per database per process: py-lmdb refuses to open
    an environment a second time ("already open in this process"; LMDB itself forbids it, as closing the
    second handle would drop the first one's locks) and LevelDB holds its ``LOCK`` file for the process.
    A TRAIN and a TEST net, or two layers, may read one database: they share its handle, refcounted, so
    the registry cannot belong to one net or config. One instance, :data:`OPEN_DATABASES`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[tuple[str, str], list] = {}  # (backend, real path) -> [handle, readers]

    def acquire(self, backend: str, key: str, opener: Callable[[], Any]) -> Any:
        """The shared handle of database ``key`` (opened with ``opener()`` the first time), one reader more."""
        with self._lock:
            entry = self._open.get((backend, key))
            if entry is None:
                entry = self._open[(backend, key)] = [opener(), 0]
            entry[1] += 1
            return entry[0]

    def release(self, backend: str, key: str) -> None:
        """One reader of ``key`` fewer; the last one closes the handle."""
        with self._lock:
            entry = self._open.get((backend, key))
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] <= 0:
                del self._open[(backend, key)]
                entry[0].close()

    def readers(self, backend: str, key: str) -> int:
        """How many readers share the open handle of ``key`` (0: not open)."""
        with self._lock:
            entry = self._open.get((backend, key))
            return 0 if entry is None else entry[1]


#: the process's open read handles (see :class:`OpenDatabases` for why they are per process)
OPEN_DATABASES = OpenDatabases()


class LMDB(DB):
    """Read-only LMDB database (a directory holding data.mdb, or a single file)."""

    backend = "lmdb"

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._env = None
        if not os.path.exists(self.path):
            raise CctError(f"LMDB '{self.path}' does not exist")
        subdir = os.path.isdir(self.path)
        if subdir and not os.path.isfile(os.path.join(self.path, "data.mdb")):
            raise CctError(f"'{self.path}' is not an LMDB (no data.mdb inside)")
        self._key = os.path.realpath(self.path)

        def opener():
            import lmdb

            try:
                return lmdb.open(self._key, readonly=True, lock=False, subdir=subdir, readahead=False,
                                 max_readers=512)
            except lmdb.Error as e:
                raise CctError(f"cannot open LMDB '{self.path}': {e}") from None

        self._env = OPEN_DATABASES.acquire("lmdb", self._key, opener)
        self._entries = int(self._env.stat()["entries"])

    def __len__(self) -> int:
        return self._entries

    def cursor(self) -> LMDBCursor:
        return LMDBCursor(self._env, self.path)

    def close(self) -> None:
        if self._env is not None:
            self._env = None
            OPEN_DATABASES.release("lmdb", self._key)


class LevelDBCursor(Cursor):
    """Cursor over a LevelDB (plyvel iterator)."""

    def __init__(self, db, path: str):
        self.path = path
        self._db = db
        self.seek_to_first()

    def seek_to_first(self) -> None:
        self._it = self._db.iterator()
        self.next()

    def next(self) -> None:
        try:
            self._kv = next(self._it)
        except StopIteration:
            self._kv = None

    @property
    def valid(self) -> bool:
        return self._kv is not None

    @property
    def key(self) -> bytes:
        return self._kv[0]

    @property
    def value(self) -> bytes:
        return self._kv[1]

    def close(self) -> None:
        self._it.close()


class LevelDB(DB):
    """Read-only LevelDB database (needs plyvel)."""

    backend = "leveldb"

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.exists(self.path):
            raise CctError(f"LevelDB '{self.path}' does not exist")
        plyvel = _import_plyvel(self.path)
        self._key = os.path.realpath(self.path)

        def opener():
            try:
                return plyvel.DB(self._key, create_if_missing=False)
            except Exception as e:  # plyvel.Error, IOError
                raise CctError(f"cannot open LevelDB '{self.path}': {e}") from None

        # LevelDB allows one open handle per process: TRAIN and TEST nets share it.
        self._db = OPEN_DATABASES.acquire("leveldb", self._key, opener)
        self._entries: int | None = None

    def __len__(self) -> int:
        if self._entries is None:  # LevelDB keeps no count: walk the keys once
            self._entries = sum(1 for _ in self._db.iterator(include_value=False))
        return self._entries

    def is_empty(self) -> bool:
        it = self._db.iterator(include_value=False)
        try:
            return next(it, None) is None
        finally:
            it.close()

    def cursor(self) -> LevelDBCursor:
        return LevelDBCursor(self._db, self.path)

    def close(self) -> None:
        if self._db is not None:
            self._db = None
            OPEN_DATABASES.release("leveldb", self._key)


def open_db(path: str | os.PathLike, backend: str | int = "lmdb", allow_empty: bool = False) -> DB:
    """Open a database read-only; a missing or (unless ``allow_empty``) empty one is an error naming it."""
    name = backend_name(backend)
    db: DB = LMDB(path) if name == "lmdb" else LevelDB(path)
    if not allow_empty and db.is_empty():
        db.close()
        raise CctError(f"{name.upper()} '{os.fspath(path)}' is empty")
    return db


def parse_datum(value: bytes, key: bytes | str = b"?", source: str = "") -> caffe_pb2.Datum:
    """Parse a record as a ``Datum`` and check it is consistent; errors name the key (and database)."""
    datum = caffe_pb2.Datum()
    where = f" in '{source}'" if source else ""
    k = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
    try:
        datum.ParseFromString(value)
    except Exception:
        raise CctError(f"record '{k}'{where} is not a valid Datum (corrupt record)") from None
    if datum.encoded:
        if not datum.data:
            raise CctError(f"record '{k}'{where}: encoded Datum without image bytes (corrupt record)")
        return datum
    bad = f"record '{k}'{where} is not a valid Datum (corrupt record)"
    for field in ("channels", "height", "width"):
        if getattr(datum, field) <= 0:
            raise CctError(f"{bad}: {field} = {getattr(datum, field)} is not positive")
    size = datum.channels * datum.height * datum.width
    held = ("data", len(datum.data), "bytes") if datum.data else ("float_data", len(datum.float_data), "values")
    if held[1] != size:
        raise CctError(f"{bad}: channels x height x width = {datum.channels}x{datum.height}x{datum.width} needs "
                       f"{size} values but {held[0]} holds {held[1]} {held[2]}")
    return datum


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------
class DBWriter:
    """Write-once database builder: ``put(key, value)``, committed every ``commit_every`` records."""

    path: str

    def __init__(self, commit_every: int = 1000):
        self.commit_every = commit_every
        self._pending: list[tuple[bytes, bytes]] = []
        self.count = 0

    def put(self, key: bytes | str, value: bytes) -> None:
        """Queue one record (committed in batches)."""
        if isinstance(key, str):
            key = key.encode("utf-8")
        self._pending.append((key, value))
        self.count += 1
        if len(self._pending) >= self.commit_every:
            self.commit()

    def commit(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def __enter__(self) -> DBWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:  # keep the partial database closed but do not hide the error
            try:
                self.close()
            except Exception:
                pass


def _check_new(path: str) -> None:
    if os.path.exists(path):
        raise CctError(f"database '{path}' already exists (remove it first)")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise CctError(f"cannot create database '{path}': directory '{parent}' does not exist")


class LMDBWriter(DBWriter):
    """Creates a new LMDB directory; the map size doubles whenever a commit does not fit (as Caffe)."""

    def __init__(self, path: str | os.PathLike, map_size: int = 1 << 24, commit_every: int = 1000):
        import lmdb

        super().__init__(commit_every)
        self.path = os.fspath(path)
        _check_new(self.path)
        self._lmdb = lmdb
        self._map_size = int(map_size)
        self._env = lmdb.open(self.path, map_size=self._map_size, subdir=True, meminit=False)

    def commit(self) -> None:
        """Write the queued records in one transaction, growing the map as needed."""
        if not self._pending:
            return
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    for k, v in self._pending:
                        txn.put(k, v)
                break
            except self._lmdb.MapFullError:
                self._map_size *= 2
                self._env.set_mapsize(self._map_size)
        self._pending.clear()

    def close(self) -> None:
        """Commit what is left, flush and close."""
        if self._env is None:
            return
        self.commit()
        self._env.sync(True)
        self._env.close()
        self._env = None


class LevelDBWriter(DBWriter):
    """Creates a new LevelDB (needs plyvel)."""

    def __init__(self, path: str | os.PathLike, commit_every: int = 1000):
        super().__init__(commit_every)
        self.path = os.fspath(path)
        _check_new(self.path)
        plyvel = _import_plyvel(self.path)
        self._db = plyvel.DB(self.path, create_if_missing=True, error_if_exists=True,
                             write_buffer_size=64 << 20)

    def commit(self) -> None:
        """Write the queued records in one write batch."""
        if not self._pending:
            return
        with self._db.write_batch() as wb:
            for k, v in self._pending:
                wb.put(k, v)
        self._pending.clear()

    def close(self) -> None:
        """Commit what is left and close."""
        if self._db is None:
            return
        self.commit()
        self._db.close()
        self._db = None


def open_writer(path: str | os.PathLike, backend: str | int = "lmdb") -> DBWriter:
    """A writer creating a new database at ``path`` (error if it already exists)."""
    name = backend_name(backend)
    return LMDBWriter(path) if name == "lmdb" else LevelDBWriter(path)
