"""Drop-ins for the RL frameworks our users already run (import the submodule you need).

- :mod:`nemo_fp8rl.integrations.nemo_rl`: ``ClippedPGLossFn``, a NeMo RL ``LossFunction`` that replaces
  NeMo RL's own ``ClippedPGLossFn`` (same call, config keys, metrics) with Calibrated Clipping bounds.
- :mod:`nemo_fp8rl.integrations.verl`: registers the ``calibrated_clip`` policy loss in verl's registry
  and a hook that feeds the BF16 shadow ratios of a calibration step to the controller.

Neither NeMo RL nor verl is imported here; each submodule imports only what it needs, when it needs it.
See docs/integrations.md.
"""
