"""cct's own commands (``train``, ``test``, ``time``, ``device_query``), one module per command, each with a
``build_parser()`` and a ``run(args)``; :data:`cct.cli.COMMANDS` registers them next to the tools' commands."""
