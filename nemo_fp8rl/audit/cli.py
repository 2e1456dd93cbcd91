"""``nemo-fp8rl-audit`` (= ``python -m nemo_fp8rl.audit``): the trainer's Hydra config and overrides, plus ``audit.*``.

    nemo-fp8rl-audit model=smollm2_135m task=reasoning_gym output_dir=runs/audit_smollm2
    nemo-fp8rl-audit model=qwen3_8b model.hf_path=/models/Qwen3-8B fp8=blockwise \\
        audit.configs=[linear,kv_static,kv_calibrated,kv_calibrated+edge,train]

The report goes to ``<output_dir>/audit/`` (``audit.out`` to change it). Exit codes: 0 done, 2 the
configuration or input cannot work (nothing was computed; the message names the key or file and the fix).
"""

from __future__ import annotations

import logging
import os
import shlex
import sys

from nemo_fp8rl.train import CONF_DIR

__all__ = ["main", "register_schema"]


def register_schema() -> None:
    """Register :class:`~nemo_fp8rl.audit.settings.AuditRunConfig` under the name the trainer's config.yaml
    loads (``train_schema``): the same groups and keys, plus ``audit``."""
    from hydra.core.config_store import ConfigStore

    from nemo_fp8rl.audit.settings import AuditRunConfig

    ConfigStore.instance().store(name="train_schema", node=AuditRunConfig)


def _run(dict_cfg) -> int:
    from nemo_fp8rl.audit.run import run_audit
    from nemo_fp8rl.config.schema import ConfigError
    from nemo_fp8rl.train import to_train_config

    try:
        cfg = to_train_config(dict_cfg)
    except ConfigError as e:
        print(f"nemo-fp8rl-audit: invalid config: {e}", file=sys.stderr)
        return 2
    command = "nemo-fp8rl-audit " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    try:
        rep = run_audit(cfg, command=command)
    except ConfigError as e:
        print(f"nemo-fp8rl-audit: invalid config: {e}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as e:
        print(f"nemo-fp8rl-audit: cannot run: {e}", file=sys.stderr)
        return 2
    print(f"nemo-fp8rl-audit: report in {rep['out_dir']}/audit.md (audit.png, audit.json), "
          f"{rep['timings_s']['total']:.0f} s")
    print(f"recommended: {rep['recommendation']['line']}")
    return 0


def main() -> None:
    import hydra
    from omegaconf import DictConfig

    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    register_schema()

    @hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
    def _app(dict_cfg: DictConfig) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
        rc = _run(dict_cfg)
        if rc:
            sys.exit(rc)

    _app()
