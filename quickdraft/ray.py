"""Ray Serve entry point: `serve run quickdraft.ray:build model=smollm2-135m replicas=2`.

Stage: process entry for Ray Serve's own tools (`serve run`, `serve deploy` with a config
file's `import_path: quickdraft.ray:build`). `build(args)` takes the same options as
`quickdraft serve` (its flag names, with or without the dashes: `threads-per-replica: 1`,
`speculative-method: ngram`; `true` for a flag without a value) and returns the Serve
application of quickdraft/cluster/deploy.py. The HTTP host and port are Serve's
(`http_options` in the config file), not these options.
"""

from __future__ import annotations

from typing import Any


def build(args: dict[str, Any]) -> Any:
    from quickdraft.cli import build_parser, cluster_options, serve_options
    from quickdraft.cluster.deploy import build_app

    argv = ["serve"]
    for key, value in args.items():
        flag = "--" + key.lstrip("-").replace("_", "-")
        if flag == "--model":
            argv.append(str(value))
        elif value is True or str(value).lower() == "true":
            argv.append(flag)
        elif value is not False and str(value).lower() != "false":
            argv += [flag, str(value)]
    ns = build_parser().parse_args(argv)
    opts, config = serve_options(ns)
    return build_app(opts, config, cluster_options(ns))
