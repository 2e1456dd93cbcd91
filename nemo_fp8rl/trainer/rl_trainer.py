"""The RL loop (GRPO / DAPO / PPO presets) with FP8 rollout and training and Calibrated Clipping.

One step (docs/design.md, "One training step"), in the order :meth:`RLTrainer.step` runs it:

1. rollout: sync weights to the rollout engine (re-quantized for its FP8 scheme), sample
   ``group_size`` responses per prompt and record ``rollout_logp``;
2. rewards (reward/errors counted, DAPO overlong shaping);
3. advantages (group-relative), DAPO dynamic sampling (drop all-equal groups, sample more);
4. old log-probs: ``recompute`` (FP8 trainer forward) or ``rollout`` (the engine's); the BF16 shadow
   old log-probs on calibration steps; reference log-probs when ``kl_coef > 0``; rollout-correction
   weights (TIS / IcePop);
5. for each minibatch: the BF16 shadow forward on calibration steps (the weights this minibatch
   sees), then the FP8 forward/backward with the clip bounds in force and an optimizer step;
6. calibration update (bounds for the next step);
7. metrics (one host sync), stability monitor (entropy surge, garbled output);
8. checkpoint every ``checkpoint_interval`` steps and at the end.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import os
import signal
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.distributed as dist

from nemo_fp8rl.algorithms import (
    CalibratedClipping,
    EntropySurgeMonitor,
    agg_loss,
    dynamic_sampling_filter,
    get_advantage_estimator,
    get_policy_loss,
    kl_penalty,
    make_metric,
    metrics_to_floats,
    mismatch_metrics,
    overlong_reward_shaping,
    reduce_metrics,
    rollout_correction,
)
from nemo_fp8rl.algorithms.degeneracy import degeneracy_metrics, degenerate_signals, unlikely_token_frac
from nemo_fp8rl.config.schema import TrainConfig
from nemo_fp8rl.fp8 import collect_fp8_stats
from nemo_fp8rl.fp8 import fused
from nemo_fp8rl.fp8.recipes import build_fp8_recipe, resolve_auto_recipe
from nemo_fp8rl import machine
from nemo_fp8rl.models.parallel import comm_device
from nemo_fp8rl.trainer.calibration_pass import make_calibration_pass
from nemo_fp8rl.rollout.fp8_setup import rollout_fp8_setup
from nemo_fp8rl.trainer.checkpoint import CheckpointManager
from nemo_fp8rl.trainer.kv_scales import KvScaleSync
from nemo_fp8rl.trainer.logger import MetricsLogger
from nemo_fp8rl.trainer import timing
from nemo_fp8rl.trainer.profiling import StepProfiler
from nemo_fp8rl.validation import validate

logger = logging.getLogger(__name__)


def model_fingerprint(cfg: TrainConfig) -> Dict[str, object]:
    """Config keys that must not change across a resume (they shape the model, optimizer state or layout)."""
    # hf_path is where the weights came from, not what they are: moving the checkpoint must not block resume
    fp = {f"model.{k}": v for k, v in dataclasses.asdict(cfg.model).items() if k not in ("name", "hf_path")}
    fp.update({f"parallel.{k}": v for k, v in dataclasses.asdict(cfg.parallel).items() if k != "backend"})
    fp["fp8.recipe"] = cfg.fp8.recipe
    fp["fp8.amax_history_len"] = cfg.fp8.amax_history_len
    fp["task.name"] = cfg.task.name
    fp["calibration.enabled"] = cfg.calibration.enabled
    fp["seed"] = cfg.seed
    return fp


class StopTraining(Exception):
    """Raised to stop the loop cleanly (non-finite updates in a row); a checkpoint has been written."""


class RLTrainer:
    """Owns the task, actor, rollout engine, calibration controller, logger and checkpoints of one run."""

    def __init__(self, cfg: TrainConfig) -> None:
        from megatron.core import parallel_state as ps

        from nemo_fp8rl.models import build_actor, init_distributed
        from nemo_fp8rl.models.hf_config import resolve_model_config
        from nemo_fp8rl.models.hf_load import load_hf_policy
        from nemo_fp8rl.rollout import SamplingParams
        from nemo_fp8rl.tasks import get_task, task_class, task_kwargs

        cfg.model = resolve_model_config(cfg.model)  # model.hf_path: shape from config.json
        self.cfg = validate(cfg)
        a = cfg.algorithm
        self.out = Path(cfg.output_dir)
        _check_writable(self.out)
        # Each data-parallel rank draws its own prompt stream (the task's own RNG, saved in checkpoints);
        # a dataset task gives each rank a disjoint share of every epoch.
        init_distributed(cfg.parallel, cfg.model)
        dp_rank = ps.get_data_parallel_rank()
        task_kw = task_kwargs(cfg, task_class(cfg.task.name), seed=cfg.seed * 1000 + 29 + dp_rank,
                              dp_rank=dp_rank, dp_size=ps.get_data_parallel_world_size())
        if cfg.model.hf_path:  # a pretrained policy speaks its own tokenizer (and chat template)
            if "tokenizer" not in inspect.signature(task_class(cfg.task.name)).parameters:
                raise ValueError(
                    f"task.name={cfg.task.name!r} has a built-in tokenizer and cannot use model.hf_path's; "
                    "use task=math_jsonl with a Hugging Face checkpoint, or model.hf_path=null"
                )
            task_kw["tokenizer"] = cfg.model.hf_path
        self.task = get_task(cfg.task.name, **task_kw)
        tok = self.task.tokenizer
        self.model_cfg = dataclasses.replace(cfg.model, vocab_size=cfg.model.vocab_size or tok.vocab_size)
        if self.model_cfg.vocab_size < tok.vocab_size:
            raise ValueError(
                f"model.vocab_size={self.model_cfg.vocab_size} is smaller than the task tokenizer's "
                f"{tok.vocab_size}; set model.vocab_size=null to take it from the tokenizer"
            )
        resolve_auto_recipe(cfg)  # fp8=auto: the recipe for this rank's device, written into cfg (config.yaml)
        fused.set_compile_mode(cfg.fp8.compile)  # fp8.compile: fused (torch.compile) or eager quantization
        self.recipe = build_fp8_recipe(cfg)
        self.actor = (load_hf_policy if cfg.model.hf_path else build_actor)(
            self.model_cfg, cfg.parallel, fp8_recipe=self.recipe, seed=cfg.seed, lr=cfg.optim.lr,
            weight_decay=cfg.optim.weight_decay, adam_betas=(cfg.optim.beta1, cfg.optim.beta2),
            grad_clip=cfg.optim.grad_clip, keep_reference=False, fp8_backend=cfg.fp8.backend,
            distributed_optimizer=cfg.optim.distributed,
            # fp8.backend=auto (null): the rule of fp8/layer_filter.py judges each layer at a micro-batch's rows
            # (at most micro_batch_size x seq_length)
            fp8_auto_tokens=cfg.parallel.micro_batch_size * cfg.model.seq_length,
        )
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.profiler = StepProfiler(cfg.trainer.profile, self.rank, dist.get_world_size() if dist.is_initialized() else 1,
                                     self.out)
        if a.prompts_per_step % self.actor.dp_size:
            raise ValueError(
                f"algorithm.prompts_per_step={a.prompts_per_step} must be divisible by the data-parallel size "
                f"{self.actor.dp_size}"
            )
        self.local_prompts = a.prompts_per_step // self.actor.dp_size
        self.engine, self._split = self._build_engine(tok)
        self.kv_sync = KvScaleSync(self.rollout_fp8, self.model_cfg, task=self.task, seed=cfg.seed, dp_rank=dp_rank,
                                   prompts=self.local_prompts, group_size=a.group_size, device=self.actor.device,
                                   pad_id=tok.pad_id)
        self.sampling = SamplingParams.from_config(cfg.rollout)  # temperature, top-p, lengths, EOS, stop strings
        self.policy_loss = get_policy_loss(a.policy_loss)
        self.adv_fn = get_advantage_estimator(a.adv_estimator)
        c = cfg.calibration
        self.calibrator: Optional[CalibratedClipping] = None
        if c.enabled:
            self.calibrator = CalibratedClipping(
                eps_low=a.eps_low, eps_high=a.eps_high, interval=c.interval, ema=c.ema, upper_mode=c.upper_mode,
                lower_min=c.lower_min, upper_max=c.upper_max, min_tokens=c.min_tokens, max_tokens=c.max_tokens,
                start_step=c.start_step, init_lower=c.init_lower, init_upper=c.init_upper, apply=c.apply,
                window=c.window, seed=cfg.seed,
            )
        self.calibration = make_calibration_pass(self.calibrator, self.actor, cfg.rollout.temperature)
        self.monitor = EntropySurgeMonitor(window=cfg.stability.window, factor=cfg.stability.surge_factor,
                                           min_rise=cfg.stability.surge_min_rise)
        # Every random draw of the loop comes from these generators (saved in checkpoints): resume is exact.
        dp = self.actor.dp_rank
        self.rollout_gen = torch.Generator().manual_seed(_stream_seed(cfg.seed, "rollout", dp))
        self.shuffle_gen = torch.Generator().manual_seed(_stream_seed(cfg.seed, "shuffle", dp))
        self.ckpt = CheckpointManager(cfg.output_dir, keep_last=cfg.trainer.keep_last,
                                      async_save=cfg.trainer.async_save)
        self.step_idx = 0
        self.consecutive_skips = 0
        self.skipped_total = 0
        self.unstable_steps = 0  # consecutive steps flagged by the stability monitor
        self._stop_signal: Optional[int] = None
        # Preemption (SIGUSR1 from SLURM, SIGTERM) and Ctrl-C from the start, so a signal during
        # warm-up is not lost: the first RL step finishes, checkpoints and exits.
        self._old_handlers = {}
        for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            try:
                self._old_handlers[s] = signal.signal(s, self._on_signal)
            except ValueError:  # not the main thread (library use): the caller handles signals
                pass
        self._start_decided = False  # decide_start(): fresh or resume, once for all ranks
        self._resume_step: Optional[int] = None
        self.logger: Optional[MetricsLogger] = None
        self._samples_written = -1  # the last step whose generations went to samples.jsonl (logger.samples)
        self._log_file: Optional[logging.Handler] = None

    def _build_engine(self, tok):
        """The rollout engine (collective: every rank builds its share of it) and the rollout split
        ``(group, share, shares, leader)`` of :meth:`_engine_generate`, or None when every rank generates
        the whole batch."""
        from nemo_fp8rl.rollout import get_rollout_engine

        cfg = self.cfg
        # The bf16 arm is high precision end to end: no FP8 in the rollout either.
        self.rollout_fp8 = rollout_fp8_setup(cfg, self.model_cfg.num_layers, training_fp8=self.recipe is not None)
        # Who generates what (_engine_generate). A replica's M model-parallel ranks hold M / T rollout
        # engines (T = rollout.tensor_parallel_size; vLLM groups T consecutive global ranks, which must lie
        # in one replica: checked here on every rank alike, before the engine build, which is collective).
        split = cfg.rollout.splits_prompts
        mp_size = dist.get_world_size(self.actor.mp_group) if dist.is_initialized() else 1
        rollout_tp = cfg.rollout.tensor_parallel_size if cfg.rollout.engine == "vllm" else 1
        share, n_shares, leader = (dist.get_rank(self.actor.mp_group) if dist.is_initialized() else 0), mp_size, True
        if rollout_tp > 1:
            from nemo_fp8rl.config.schema import ConfigError
            from nemo_fp8rl.rollout.vllm_spmd import rollout_share_layout

            replicas: list = [None] * dist.get_world_size()
            dist.all_gather_object(replicas, dist.get_process_group_ranks(self.actor.mp_group))
            try:
                share, n_shares, leader = rollout_share_layout(replicas, dist.get_rank(), rollout_tp)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        engine_kw = {}
        if cfg.rollout.engine == "torch":
            # the in-process engine lives where the actor does; on a GPU whose trainer runs real FP8
            # (fp8.backend torch or te) its FP8 schemes use torch's FP8 GEMMs too. Its dtype is the engine's
            # default: BF16 on CUDA, float32 on CPU (torch_engine.engine_dtype); each sync sends the weights
            # there (_weight_stream)
            real = self.actor.fp8_backend in ("torch", "te") and self.actor.device.type == "cuda"
            engine_kw = {"device": self.actor.device, "fp8_gemm": "torch" if real else "emulate"}
        engine = get_rollout_engine(
            cfg.rollout.engine, self.model_cfg, **self.rollout_fp8.engine_kwargs(), train_recipe=self.recipe,
            eos_id=tok.eos_id, pad_id=tok.pad_id, eos_ids=getattr(tok, "eos_ids", None), options=cfg.rollout,
            tokenizer=tok if cfg.rollout.stop else None,  # rollout.stop: the engine decodes responses
            **engine_kw,
        )
        if rollout_tp > 1:
            block = dist.get_rank() - dist.get_rank() % rollout_tp
            if list(engine.tp_group_ranks) != list(range(block, block + rollout_tp)):
                raise RuntimeError(f"vLLM formed the tensor-parallel group {engine.tp_group_ranks} for rank "
                                   f"{dist.get_rank()}, not the consecutive ranks the rollout split assumes")
        # (group, share, shares, leader): this rank's engine generates share `share` of `shares`; the
        # leaders' (first rank of each vLLM group) shares are gathered over the replica.
        split_share = (self.actor.mp_group, share, n_shares, leader) if split and mp_size > 1 else None
        if split_share is not None:
            logger.info("rollout: each of the %d rollout engines (rollout.tensor_parallel_size=%d) of a replica's %d "
                        "model-parallel ranks generates 1/%d of its batch (rollout.split_prompts)",
                        n_shares, rollout_tp, mp_size, n_shares)
        return engine, split_share

    # ------------------------------------------------------------------ setup
    def check_run_dir(self) -> None:
        """Refuse to start a fresh run in a directory that holds another run (nothing is overwritten).

        Local check of this process's view of ``output_dir``; a multi-rank run decides through
        :meth:`decide_start`, which runs this on global rank 0 only.
        """
        if not self.cfg.resume and (self.ckpt.steps() or (self.out / "metrics.jsonl").exists()):
            raise ValueError(
                f"{self.out} already holds a run (checkpoints {self.ckpt.steps()}); pass resume=true to continue "
                "that run or choose a new output_dir (nothing was overwritten)"
            )

    def decide_start(self) -> Optional[int]:
        """Fresh start or resume, decided once for all ranks before any rank writes to ``output_dir``.

        Global rank 0 checks the run directory (:meth:`check_run_dir`) and picks the checkpoint to resume
        from; its answer, or its error, is broadcast to every rank. Deciding on every rank separately was a
        race: rank 0 creates ``metrics.jsonl`` in :meth:`setup`, and a slower rank that looked at the
        directory after that refused a fresh run as "already holds a run" while rank 0 went on into the
        first collective. Now every rank starts the same way or raises the same error. Memoised: the
        first call decides (it is a collective: call it on every rank), later calls return the decision.

        Returns:
            The checkpoint step to resume from, or None for a fresh start.
        """
        if self._start_decided:
            return self._resume_step
        answer: list = [None, None]  # [resume step, exception]
        if self.rank == 0:
            try:
                self.check_run_dir()
                answer[0] = self.ckpt.latest_step() if self.cfg.resume else None
            except Exception as e:  # noqa: BLE001  (any error reaches every rank: none waits in the broadcast)
                answer[1] = e
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(answer, src=0, device=comm_device())
        self._start_decided = True
        self._resume_step, err = answer
        if err is not None:
            raise err
        return self._resume_step

    def setup(self, *, warm_start: Optional[Dict[str, torch.Tensor]] = None) -> None:
        """Resume from the latest checkpoint (``resume=true``) or load warm-start weights; open the logger."""
        start = 0
        latest = self.decide_start()
        # The run's own log, next to its metrics: opened once the directory is known to be this run's (a
        # directory of another run was refused above, its log untouched), so a resume is logged in it too.
        if self.rank == 0 and self._log_file is None:
            self._log_file = logging.FileHandler(self.out / "train.log")
            self._log_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            logging.getLogger().addHandler(self._log_file)
            # where this part of the run ran: a resumed run may continue on another machine (other kernels)
            gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
            logger.info("machine: %s; world size %d", machine.describe_line(torch.get_num_threads(), gpu),
                        dist.get_world_size() if dist.is_initialized() else 1)
        if latest is not None:
            self._restore(self.ckpt.load(latest, model_fingerprint(self.cfg)))
            start = self.step_idx
            logger.info("resumed from %s/checkpoints/step_%d", self.cfg.output_dir, latest)
        else:
            if warm_start is not None:
                self.actor.load_weights(warm_start)
        if self.cfg.algorithm.kl_coef > 0 and not self.actor.has_reference:
            self.actor.keep_reference()  # the RL starting point (after warm-up) is the reference policy
        self.logger = MetricsLogger(
            self.cfg.output_dir, tensorboard=self.cfg.logger.tensorboard, progress=self.cfg.logger.progress,
            max_steps=self.cfg.trainer.max_steps, start_step=start, enabled=self.rank == 0,
        )

    # ------------------------------------------------------------------ rollout
    def _generate(self, n_prompts: int):
        """Sample ``group_size`` responses for ``n_prompts`` new prompts; rewards and advantages."""
        a = self.cfg.algorithm
        prompts = self.task.prompts(n_prompts)
        expanded = [p for p in prompts for _ in range(a.group_size)]
        batch = self._engine_generate([p.ids for p in expanded])
        texts = [self.task.response_text(r) for r in batch.responses()]
        scores = self.task.score(expanded, texts)
        if self.step_idx in self.cfg.logger.samples and self._samples_written != self.step_idx and self.logger:
            self._samples_written = self.step_idx  # the step's first rollout round (dynamic sampling may add more)
            self.logger.log_samples(self.step_idx, self._sample_records(expanded, texts, scores))
        rewards = scores.rewards.clone()
        if a.overlong_buffer_len > 0:
            rewards = rewards + overlong_reward_shaping(
                batch.response_lens, self.sampling.max_new_tokens, a.overlong_buffer_len, a.overlong_penalty_factor
            )
        adv = self.adv_fn(rewards, a.group_size, **({"norm_by_std": a.norm_adv_by_std} if a.adv_estimator == "grpo" else {}))
        return batch, scores, rewards, adv

    def _sample_records(self, expanded, texts, scores) -> list[dict]:
        """``logger.samples_per_step`` decoded generations: the first response of each of the first prompts."""
        tok, g = self.task.tokenizer, self.cfg.algorithm.group_size
        return [{"prompt": tok.decode(expanded[i].ids), "question": expanded[i].text, "answer": expanded[i].answer,
                 "response": texts[i], "reward": float(scores.rewards[i]), "correct": bool(scores.correct[i]),
                 "invalid": bool(scores.invalid[i])}
                for i in range(0, len(expanded), g)[: self.cfg.logger.samples_per_step]]

    def _engine_generate(self, prompts: list[list[int]]):
        """The engine's batch for ``prompts``, the same on every model-parallel rank of the replica.

        Without ``rollout.split_prompts`` every rank generates all of it with ``rollout_gen`` (with
        ``rollout.tensor_parallel_size`` T > 1 each vLLM group of T ranks generates it together: the
        replica's ranks share prompts and generator state). With it, the replica's M model-parallel ranks
        hold S = M / T engines; engine k generates rows [k B / S, (k + 1) B / S) with a generator seeded
        from one draw of ``rollout_gen`` (+ k), the same on all T ranks of that engine, and the shares of
        the engines' first ranks are all-gathered in share order. Every rank advances ``rollout_gen``
        alike (resume stays exact) and trains on the same batch. T = 1: S = M, engine k is rank k.
        """
        from nemo_fp8rl.rollout import RolloutBatch

        if self._split is None:
            return self.engine.generate(prompts, self.sampling, self.rollout_gen)
        group, share, n_shares, leader = self._split
        base = int(torch.randint(0, 2**62, (1,), generator=self.rollout_gen))
        B = len(prompts)
        lo, hi = share * B // n_shares, (share + 1) * B // n_shares
        mine = None
        if hi > lo:
            share_gen = torch.Generator().manual_seed(base + share)
            mine = self.engine.generate(prompts[lo:hi], self.sampling, share_gen)
        shares: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(shares, (share, mine) if leader and mine is not None else None, group=group)
        return RolloutBatch.concat([b for _, b in sorted((s for s in shares if s is not None), key=lambda s: s[0])],
                                   self.task.tokenizer.pad_id)

    def _rollout(self):
        """Rollout with DAPO dynamic sampling: keep groups with reward variance, sample more to refill."""
        a = self.cfg.algorithm
        batch, scores, rewards, adv = self._generate(self.local_prompts)
        if not a.dynamic_sampling:
            return batch, scores, rewards, adv, {}
        parts = [(batch, scores, rewards, adv)]
        keep, kept_frac = dynamic_sampling_filter(rewards, a.group_size)
        group_keeps = [keep.view(-1, a.group_size)[:, 0].tolist()]  # one flag per group, per round
        rounds = 0
        while sum(map(sum, group_keeps)) < self.local_prompts and rounds < a.max_resample_rounds:
            rounds += 1
            b, s, r, ad = self._generate(self.local_prompts)
            parts.append((b, s, r, ad))
            group_keeps.append(dynamic_sampling_filter(r, a.group_size)[0].view(-1, a.group_size)[:, 0].tolist())
        # Select kept groups first (in sampling order); fill with dropped ones (zero advantage: no
        # gradient) when even the extra rounds did not find enough informative groups.
        sel, fill = [], []
        for i, flags in enumerate(group_keeps):
            for g, kg in enumerate(flags):
                (sel if kg else fill).append((i, g))
        chosen = (sel + fill)[: self.local_prompts]
        merged = _merge_groups(parts, chosen, a.group_size, self.task.tokenizer.pad_id)
        stats = {
            "rollout/dynamic_kept_frac": make_metric(torch.tensor(float(kept_frac)), "mean"),
            "rollout/dynamic_rounds": make_metric(torch.tensor(float(rounds)), "mean"),
            "rollout/dynamic_filled_groups": make_metric(torch.tensor(float(max(0, len(chosen) - len(sel)))), "mean"),
        }
        return (*merged, stats)

    def _weight_stream(self):
        """The actor's weights for the step's sync, one HF-named tensor at a time.

        A colocated engine that names a ``sync_target`` (the torch engine: its device and dtype) gets them
        there (``FP8Actor.iter_weights(device, dtype)``, also across pipeline stages), so a GPU sync is a
        device-to-device copy in BF16 with no host round trip and no float32 copy; other engines get
        float32 CPU tensors (what the vLLM sync takes).
        """
        target = getattr(self.engine, "sync_target", None)
        if target is None:
            return self.actor.iter_weights()
        device, dtype = target
        return self.actor.iter_weights(device=device, dtype=dtype)

    # ------------------------------------------------------------------ one step
    def step(self) -> Dict[str, float]:
        """One RL step (docs/design.md, "One training step"): rollout, rewards and advantages; old, shadow and reference
        log-probs; minibatch updates with the clip bounds in force; the calibration update; metrics."""
        timings: Dict[str, float] = {}
        with timing.timed(timings, "step"):  # every phase timer waits for the GPU at its ends (trainer/timing.py)
            out = self._step(timings)
        out.update({f"timing/{k}": v for k, v in timings.items()})
        self.step_idx += 1
        return out

    def _step(self, timings: Dict[str, float]) -> Dict[str, float]:
        """The body of :meth:`step`: its metrics, the phase times added to ``timings``."""
        a = self.cfg.algorithm
        self.calibration.begin(self.step_idx)

        # 1-3: rollout, rewards, advantages
        with timing.timed(timings, "rollout"):
            with timing.timed(timings, "weight_sync"):  # part of timing/rollout
                # streamed layer by layer (TP-gathered, PP-broadcast): never a full copy of the model per rank
                kv_metrics = self.kv_sync.sync(self.engine, self._weight_stream())  # + FP8 KV-cache scales
            batch, scores, rewards, adv, ds_metrics = self._rollout()
            self.kv_sync.observe(batch)  # the next sync's KV-scale calibration data
            self.engine.sleep()  # a colocated GPU engine frees its memory for training (the next sync wakes it)
        mask = batch.mask.float()
        rollout_logp = batch.rollout_logp.float() * mask

        # 4: old / shadow / reference log-probs, rollout correction
        with timing.timed(timings, "logprobs"):
            if a.old_logprobs == "recompute":
                old_logp = self.actor.get_logprobs(batch.tokens, temperature=self.cfg.rollout.temperature)[0] * mask
            else:
                old_logp = rollout_logp
            ref_logp = self.actor.get_reference_logprobs(batch.tokens, temperature=self.cfg.rollout.temperature)[0] \
                if a.kl_coef > 0 else None
        hp_old = self.calibration.shadow_old_logprobs(batch.tokens, mask)
        weights, rc_metrics = rollout_correction(old_logp, rollout_logp, mask, mode=a.rollout_correction,
                                                 **self._rollout_correction_kw())
        data = {"tokens": batch.tokens, "mask": mask, "advantages": adv.view(-1, 1).float() * mask,
                "old_logp": old_logp, "weights": weights.detach(), "rollout_logp": rollout_logp}
        if ref_logp is not None:
            data["ref_logp"] = ref_logp * mask
        if hp_old is not None:
            data["hp_old_logp"] = hp_old

        # 5: minibatch updates with the bounds in force
        lower, upper = self.calibration.bounds(1.0 - a.eps_low, 1.0 + a.eps_high)
        shadow_before = self.calibration.shadow_s
        with timing.timed(timings, "train"):
            mb_metrics = self._update(data, lower, upper)
        minibatch_shadow = self.calibration.shadow_s - shadow_before
        timings["shadow"] = self.calibration.shadow_s  # the old-policy and minibatch shadow forwards
        timings["train"] -= minibatch_shadow

        # 6: calibration update (bounds apply from the next step)
        calib_metrics = self.calibration.finish()

        # 7: metrics
        local: Dict = {
            "reward/mean": make_metric(scores.rewards.mean(), "mean"),
            "reward/shaped_mean": make_metric(rewards.mean(), "mean"),
            "reward/accuracy": make_metric(scores.correct.float().mean(), "mean"),
            "reward/errors": make_metric(torch.tensor(float(scores.errors)), "sum"),
            "rollout/invalid_frac": make_metric(scores.invalid.float().mean(), "mean"),
            "rollout/response_len": make_metric(batch.response_lens.float().mean(), "mean"),
            # responses that ended before max_new_tokens: on EOS or, with rollout.stop, on a stop string
            "rollout/eos_frac": make_metric(batch.finished.float().mean(), "mean"),
        }
        if scores.trailing is not None:  # tasks with a closing answer tag: text after it (task.trailing_text_penalty)
            local["reward/trailing_text"] = make_metric(scores.trailing.float().mean(), "mean")
        if scores.unclosed is not None:  # final answers read from a tag never closed (the lenient parse)
            local["reward/unclosed_answer"] = make_metric(scores.unclosed.float().mean(), "mean")
        local.update(ds_metrics)
        local.update(kv_metrics)
        if hasattr(self.task, "skipped_rows"):  # data.on_error=skip: malformed rows seen so far
            local["data/skipped_rows"] = make_metric(torch.tensor(float(self.task.skipped_rows)), "max")  # same file on every rank
        local.update(rc_metrics)
        local.update(self._degeneracy_metrics(batch, hp_old, mask))
        if a.old_logprobs == "recompute":
            local.update(mismatch_metrics(old_logp, rollout_logp, mask, hp_old_logp=hp_old))
        return self._step_metrics(local, mb_metrics, calib_metrics, lower, upper)

    def _rollout_correction_kw(self) -> dict:
        """The keyword arguments of ``algorithm.rollout_correction``'s mode (TIS cap, IcePop band)."""
        a = self.cfg.algorithm
        if a.rollout_correction == "tis":
            return {"cap": a.tis_cap}
        if a.rollout_correction == "icepop":
            return {"lo": a.icepop_low, "hi": a.icepop_high}
        return {}

    def _update(self, data: Dict[str, torch.Tensor], lower: float, upper: float) -> list:
        """``algorithm.epochs`` passes of ``algorithm.minibatches_per_step`` minibatch updates over the step's
        batch (``data``: [B, ...] tensors, shuffled per epoch by ``shuffle_gen``); the minibatches' metrics."""
        a = self.cfg.algorithm
        B = data["tokens"].shape[0]
        n_mb = a.minibatches_per_step
        mb_size = B // n_mb
        mb_metrics = []
        for epoch in range(a.epochs):
            perm = torch.randperm(B, generator=self.shuffle_gen)
            for j in range(n_mb):
                idx = perm[j * mb_size:(j + 1) * mb_size] if j < n_mb - 1 else perm[j * mb_size:]
                mb = {k: v[idx] for k, v in data.items()}
                self.calibration.add_reference_ratio(mb)
                loss_fn = self._make_loss(lower, upper, first_minibatch=epoch == 0 and j == 0)
                mb_metrics.append(self.actor.train_step(mb, loss_fn, temperature=self.cfg.rollout.temperature))
        return mb_metrics

    def _step_metrics(self, local: Dict, mb_metrics: list, calib_metrics: Dict, lower: float,
                      upper: float) -> Dict[str, float]:
        """The step's metrics as floats: ``local`` (rollout, rewards, ...) reduced over data parallelism, the
        minibatches' training metrics, ``calib/*``, the bounds, counters and the stability monitor."""
        # "sum" metrics are sums over the microbatches of one minibatch (shares of the minibatch
        # value); across the step's minibatches they are averaged.
        train_m = reduce_metrics([{k: (v, "mean" if r == "sum" else r) for k, (v, r) in m.items()}
                                  for m in mb_metrics])
        skipped = float(train_m.get("train/skipped", (torch.tensor(0.0), "max"))[0])
        self.consecutive_skips = self.consecutive_skips + 1 if skipped > 0 else 0
        self.skipped_total += int(skipped > 0)
        fp8_stats = collect_fp8_stats(self.actor.model)  # read and reset every step
        if self.recipe is not None:
            local["fp8/saturation_frac"] = make_metric(fp8_stats["fp8/saturation_frac"].float(), "mean")
            local["fp8/nonfinite_amax"] = make_metric(fp8_stats["fp8/nonfinite_amax"].float(), "sum")
        merged = reduce_metrics([local], group=self.actor.dp_group if self.actor.dp_size > 1 else None)
        merged.update(train_m)
        merged.update(calib_metrics)
        out = metrics_to_floats(merged)  # the one host sync of the step
        out["clip/lower"], out["clip/upper"] = float(lower), float(upper)
        out["train/skipped_steps"] = float(self.skipped_total)
        out["train/lr"] = float(self.actor.optimizer.param_groups[0]["lr"])
        ent = out.get("policy/entropy")
        if ent is not None and math.isfinite(ent):
            out.update(metrics_to_floats(self.monitor.update(ent)))
        self._stability(out)
        return out

    def _degeneracy_metrics(self, batch, hp_old: Optional[torch.Tensor], mask: torch.Tensor) -> Dict:
        """Garbled-output signals no task parser sees (:mod:`nemo_fp8rl.algorithms.degeneracy`), from the step's
        decoded responses: ``stability/repetitive_frac``, ``repeat_run_max``, ``nonprintable_frac``,
        ``replacement_frac``; on calibration steps also ``stability/unlikely_frac``, the share of response
        tokens the BF16 shadow old log-probs ``hp_old`` [B, T] put below ``stability.unlikely_prob``."""
        st = self.cfg.stability
        texts = [self.task.response_text(r) for r in batch.responses()]
        out = degeneracy_metrics(texts, repeat_min_chars=st.repeat_min_chars, repeat_min_frac=st.repeat_min_frac)
        if hp_old is not None:
            out["stability/unlikely_frac"] = make_metric(unlikely_token_frac(hp_old, mask, st.unlikely_prob), "mean")
        return out

    def _stability(self, out: Dict[str, float]) -> None:
        """Garbled-output flag and the monitor's action (docs/design.md, "One training step"), on the synced metrics.

        ``stability/garbled = 1`` if ``rollout/invalid_frac > stability.invalid_threshold`` (the task's parser)
        or a text-level share exceeds its threshold (``stability/{repetitive,nonprintable,replacement,
        unlikely}_frac`` against ``stability.{repetitive,nonprintable,replacement,unlikely}_threshold``, and
        ``reward/unclosed_answer`` against ``stability.unclosed_answer_threshold`` for tasks that report it);
        ``stability/unstable_steps`` counts consecutive steps with a surge or garbled output.
        """
        st = self.cfg.stability
        signals = degenerate_signals(out, repetitive_frac=st.repetitive_threshold,
                                     nonprintable_frac=st.nonprintable_threshold,
                                     replacement_frac=st.replacement_threshold, unlikely_frac=st.unlikely_threshold)
        values = {n: out[f"stability/{n}"] for n in signals}
        unclosed = out.get("reward/unclosed_answer")
        if unclosed is not None and math.isfinite(unclosed) and unclosed > st.unclosed_answer_threshold:
            signals.append("unclosed_answer")  # answers the lenient parse scores while the format degrades
            values["unclosed_answer"] = unclosed
        invalid = out.get("rollout/invalid_frac", 0.0) > st.invalid_threshold
        garbled = invalid or bool(signals)
        surge = out.get("stability/entropy_surge", 0.0) > 0
        out["stability/garbled"] = float(garbled)
        self.unstable_steps = self.unstable_steps + 1 if (garbled or surge) else 0
        out["stability/unstable_steps"] = float(self.unstable_steps)
        # a warning when a streak starts and every `window` steps of it (a long streak would flood the log)
        if self.unstable_steps and st.action != "none" and (self.unstable_steps - 1) % st.window == 0:
            logger.warning(
                "step %d unstable (%s): entropy %.4f = %.2fx its baseline, invalid responses %.1f%%, text signals "
                "over their stability.*_threshold: %s; %d consecutive unstable step(s) (repeated every "
                "stability.window=%d steps while it lasts)",
                self.step_idx,
                " and ".join(w for w, f in (("entropy surge", surge), ("garbled output", garbled)) if f),
                out.get("policy/entropy", math.nan), out.get("stability/entropy_ratio", math.nan),
                100 * out.get("rollout/invalid_frac", math.nan),
                ", ".join(f"{n} {values[n]:.3f}" for n in signals) or "none",
                self.unstable_steps, st.window)

    def _make_loss(self, lower: float, upper: float, first_minibatch: bool):
        """The loss closure the actor evaluates per microbatch (on the last pipeline stage): the policy loss
        with bounds ``[lower, upper]``, the KL and entropy terms, and the calibration pass's observation."""
        a = self.cfg.algorithm

        def loss_fn(mb, logprobs, entropy, *, global_tokens, global_seqs):
            mask = mb["mask"]
            logp = logprobs * mask
            loss, metrics = self.policy_loss(
                logp, mb["old_logp"], mb["advantages"], mask, lower=lower, upper=upper, dual_clip=a.dual_clip,
                weights=mb["weights"], agg_mode=a.agg_mode, global_tokens=global_tokens, global_seqs=global_seqs,
            )
            if a.kl_coef > 0:
                kl = kl_penalty(logp, mb["ref_logp"], kind=a.kl_type)
                kl_loss = agg_loss(kl, mask, a.agg_mode, global_tokens=global_tokens, global_seqs=global_seqs)
                loss = loss + a.kl_coef * kl_loss
                metrics["policy/kl_ref"] = make_metric(kl_loss.detach(), "sum")
            ent_loss = agg_loss(entropy, mask, a.agg_mode, global_tokens=global_tokens, global_seqs=global_seqs)
            if a.entropy_coef > 0:
                loss = loss - a.entropy_coef * ent_loss
            # entropy of this microbatch's share of the minibatch mean: summed over microbatches
            metrics["policy/entropy"] = make_metric(
                (entropy.detach() * mask).sum() / global_tokens.clamp(min=1), "sum")
            if first_minibatch and a.old_logprobs == "rollout":
                # on-policy weights: this forward is the trainer's log-prob of the rollout's tokens
                metrics.update(mismatch_metrics(logp.detach(), mb["rollout_logp"], mask,
                                                hp_old_logp=mb.get("hp_old_logp")))
            self.calibration.observe(logp, mb)
            return loss, metrics

        return loss_fn

    # ------------------------------------------------------------------ checkpoints
    def _state(self) -> tuple[dict, dict]:
        """``(local, sharded)``: this rank's small state (trainer, data position, RNG, the actor's local
        part) and the actor's megatron sharded state (weights, Adam moments, reference)."""
        sharded, actor_local = self.actor.sharded_checkpoint_state()
        local = {
            "step": self.step_idx,
            "actor_local": actor_local,
            "dp_rank": self.actor.dp_rank,
            "dp_size": self.actor.dp_size,
            "task": self.task.state_dict(),
            "calibrator": self.calibrator.state_dict() if self.calibrator is not None else None,
            "monitor": self.monitor.state_dict(),
            "kv_scales": self.kv_sync.state_dict(),
            "rng": {"rollout": self.rollout_gen.get_state(), "shuffle": self.shuffle_gen.get_state(),
                    "torch": torch.get_rng_state()},
            "counters": {"consecutive_skips": self.consecutive_skips, "skipped_total": self.skipped_total,
                         "unstable_steps": self.unstable_steps},
        }
        return local, sharded

    def _restore(self, st) -> None:
        """Restore from a checkpoint: a :class:`~nemo_fp8rl.trainer.checkpoint.ShardedCheckpoint`
        (format 2, any layout) or a per-rank state dict (format 1, same layout)."""
        from nemo_fp8rl.tasks.base import reshard_seed
        from nemo_fp8rl.trainer.checkpoint import ShardedCheckpoint

        if not isinstance(st, ShardedCheckpoint):
            self.actor.load_checkpoint_state(st["actor"])
            self._restore_run_state(st, per_rank=True)
            return
        self.ckpt.device = self.actor.device
        states = st.rank_states
        self.actor.load_sharded_checkpoint([s["actor_local"] for s in states], st.load_sharded)
        a = self.actor
        # Per-DP-rank streams (prompts, sampling, minibatch order, torch's CPU RNG) continue exactly when
        # the DP size is unchanged: take them from a saved rank of this DP rank (the one at this rank's
        # coordinates if the layout is unchanged).
        old_dp = int(states[0]["dp_size"])
        if old_dp == a.dp_size:
            me = {"tp_rank": a.tp_rank, "pp_rank": a.pp_rank, "dp_rank": a.dp_rank}
            src = next((s for s in states if s["actor_local"]["coords"] == me), None) or \
                next(s for s in states if s["dp_rank"] == a.dp_rank)
            self._restore_run_state(src, per_rank=True)
            return
        # Another DP size: no saved rank owns this rank's streams, and the streams as built (seeded by
        # seed and DP rank) would replay the run's opening prompts and samples on DP rank 0. The task
        # continues the saved data position from every saved DP rank's state (a dataset task: the saved
        # epoch, resharded); the trainer's streams are re-seeded from (seed, DP rank, resumed step).
        self._restore_run_state(states[0], per_rank=False)
        self._merge_calibration_round(states)
        step = self.step_idx
        by_dp = {}
        for s in states:
            by_dp.setdefault(int(s["dp_rank"]), s)
        if sorted(by_dp) != list(range(old_dp)):
            raise ValueError(f"checkpoint {st.directory} holds the states of DP ranks {sorted(by_dp)} of a DP={old_dp} "
                             "run (rank files missing?); resume from a complete checkpoint")
        task_note = self.task.reshard_state([by_dp[r]["task"] for r in range(old_dp)], a.dp_rank, a.dp_size, step)
        seeds = {name: reshard_seed(_stream_seed(self.cfg.seed, name, a.dp_rank), step)
                 for name in ("rollout", "shuffle", "torch")}
        self.rollout_gen.manual_seed(seeds["rollout"])
        self.shuffle_gen.manual_seed(seeds["shuffle"])
        torch.set_rng_state(torch.Generator().manual_seed(seeds["torch"]).get_state())  # CPU only, as restored
        logger.warning(
            "resuming step %d saved at DP=%d with DP=%d: weights, optimizer, calibration state, step, stability "
            "monitor and counters restored; DP rank %d's rollout sampling, minibatch order and CPU RNG re-seeded "
            "from (seed=%d, dp_rank=%d, step=%d) (reshard_seed: not the run's opening streams); %s",
            st.step, old_dp, a.dp_size, a.dp_rank, self.cfg.seed, a.dp_rank, step, task_note)

    def _merge_calibration_round(self, states: list) -> None:
        """Resume on another DP size inside a calibration round (``calibration.window`` > 1): the tokens
        every saved DP rank pooled so far (one state per DP rank; TP ranks and, after the pipeline broadcast,
        PP stages hold copies) go to the new DP rank 0, cut to ``max_tokens``; the others continue the round
        with none. The round's all-gather then sees the same tokens as the uninterrupted run (minus any cut)."""
        if self.calibrator is None:
            return
        by_dp = {}
        for s in states:
            if (s.get("calibrator") or {}).get("round") is not None:
                by_dp.setdefault(int(s["dp_rank"]), s["calibrator"])
        merged = CalibratedClipping.merge_rounds(list(by_dp.values()), self.calibrator.max_tokens)
        if merged is None:
            return
        if self.actor.dp_rank != 0:
            merged = {**merged, "data": None, "keys": None}
        state = self.calibrator.state_dict()
        state["round"] = merged
        self.calibrator.load_state_dict(state)

    def _restore_run_state(self, st: dict, per_rank: bool) -> None:
        """Shared state (step, calibration, monitor, counters); with ``per_rank`` also this DP rank's
        data position and RNG streams (without: :meth:`_restore` reshards or re-seeds them)."""
        self.step_idx = int(st["step"])
        if self.calibrator is not None:
            self.calibrator.load_state_dict(st["calibrator"])
        self.monitor.load_state_dict(st["monitor"])
        self.consecutive_skips = st["counters"]["consecutive_skips"]
        self.skipped_total = st["counters"]["skipped_total"]
        self.unstable_steps = st["counters"].get("unstable_steps", 0)  # absent in checkpoints before it existed
        if per_rank:
            self.task.load_state_dict(st["task"])
            self.rollout_gen.set_state(st["rng"]["rollout"])
            self.shuffle_gen.set_state(st["rng"]["shuffle"])
            torch.set_rng_state(st["rng"]["torch"])
            self.kv_sync.load_state_dict(st.get("kv_scales"))  # absent before the FP8 KV cache existed

    def save_checkpoint(self, wait: bool = False) -> Path:
        """Checkpoint this step; with ``trainer.async_save`` it is published later (each step end's
        ``ckpt.poll()``, the next save) or, ``wait``, before this returns."""
        local, sharded = self._state()
        self.ckpt.device = self.actor.device
        path = self.ckpt.save(self.step_idx, local, model_fingerprint(self.cfg), sharded=sharded)
        if wait:
            self.ckpt.wait()
        return path

    # ------------------------------------------------------------------ loop
    def _on_signal(self, signum, _frame) -> None:
        if signum == signal.SIGINT and self._stop_signal is not None:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without the checkpoint
        logger.warning("received signal %d: finishing the current step, checkpointing, exiting", signum)
        self._stop_signal = signum

    def fit(self) -> Dict[str, float]:
        """Run to ``trainer.max_steps``; checkpoint every ``checkpoint_interval`` steps and at the end (unless
        ``trainer.save_final=false``)."""
        t = self.cfg.trainer
        last: Dict[str, float] = {}
        try:
            while self.step_idx < t.max_steps:
                self.profiler.before_step(self.step_idx)  # trainer.profile: its steps, on its ranks
                metrics = self.step()
                step_done = self.step_idx - 1
                self.profiler.after_step(step_done)
                self.logger.log(step_done, metrics)
                last = metrics
                self.ckpt.poll()  # publish a finished asynchronous save (collective; no-op if none)
                if self.consecutive_skips >= t.max_consecutive_skips:
                    self.save_checkpoint(wait=True)
                    raise StopTraining(
                        f"{self.consecutive_skips} consecutive updates had a non-finite loss or gradient and were "
                        f"skipped (trainer.max_consecutive_skips={t.max_consecutive_skips}); checkpoint of the last "
                        f"good state saved at step {self.step_idx}. Lower optim.lr or check the FP8 recipe."
                    )
                if self.cfg.stability.action == "stop" and self.unstable_steps >= self.cfg.stability.patience:
                    self.save_checkpoint(wait=True)
                    raise StopTraining(
                        f"{self.unstable_steps} consecutive steps flagged unstable (entropy surge above "
                        f"stability.surge_factor={self.cfg.stability.surge_factor} x its lagged baseline, or garbled "
                        f"output: invalid responses above stability.invalid_threshold="
                        f"{self.cfg.stability.invalid_threshold} or a text signal above its stability.*_threshold); "
                        f"stability.action=stop, stability.patience={self.cfg.stability.patience}. Checkpoint saved at "
                        f"step {self.step_idx}; see metrics.jsonl (stability/*). Enable calibration=paper, lower "
                        "optim.lr, or set stability.action=warn to continue."
                    )
                if _should_stop(self._stop_signal):
                    self.save_checkpoint(wait=True)
                    logger.warning("checkpoint saved at step %d after signal; exiting for requeue", self.step_idx)
                    return last
                if t.checkpoint_interval and self.step_idx % t.checkpoint_interval == 0 and self.step_idx < t.max_steps:
                    self.save_checkpoint()
            self.ckpt.wait()  # a pending asynchronous save is published before the end is judged
            if t.save_final and self.ckpt.latest_step() != self.step_idx:
                self.save_checkpoint(wait=True)
            if self.cfg.model.hf_path:  # the trained policy back in Hugging Face format
                from nemo_fp8rl.models.hf_save import save_hf_checkpoint

                save_hf_checkpoint(self.actor, self.out / "hf")
            return last
        finally:
            self.close()

    def close(self) -> None:
        """Release what the run holds: the rollout engine, the task's reward workers, the logger and the
        run's log file, and the signal handlers it installed; writes a profile still running. Idempotent;
        :meth:`fit` calls it on every exit."""
        self.profiler.stop()
        for s, h in self._old_handlers.items():
            signal.signal(s, h)
        self._old_handlers = {}
        if self.logger is not None:
            self.logger.close()
        if self._log_file is not None:
            logging.getLogger().removeHandler(self._log_file)
            self._log_file.close()
            self._log_file = None
        self.task.close()
        self.engine.close()


def _should_stop(sig: Optional[int]) -> bool:
    """All ranks agree to stop if any rank received the signal (one MAX all-reduce, on the device the
    default backend needs: NCCL refuses CPU tensors)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return sig is not None
    flag = torch.tensor([1.0 if sig is not None else 0.0], device=comm_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


_STREAM_SEED_OFFSETS = {"rollout": 17, "shuffle": 43, "torch": 61}
"""Per-DP-rank random streams of the trainer: seed * 1000 + offset + DP rank (the task's own are + 29)."""


def _stream_seed(seed: int, name: str, dp_rank: int) -> int:
    """The seed of the trainer's ``name`` stream on DP rank ``dp_rank`` (``torch``: only re-seeded when a
    resume changes the DP size; otherwise torch's CPU RNG is saved and restored)."""
    return seed * 1000 + _STREAM_SEED_OFFSETS[name] + dp_rank


def _merge_groups(parts, chosen, group_size: int, pad_id: int):
    """Concatenate the chosen (part, group) pairs of several rollouts into one batch, re-padded."""
    from nemo_fp8rl.rollout import RolloutBatch
    from nemo_fp8rl.tasks.base import Scores

    rows = [(i, g * group_size + k) for i, g in chosen for k in range(group_size)]
    width = max(p[0].tokens.shape[1] for p in parts)

    def take(name, pad_value):
        return torch.stack([
            torch.nn.functional.pad(getattr(parts[i][0], name)[r], (0, width - parts[i][0].tokens.shape[1]),
                                    value=pad_value)
            for i, r in rows
        ])

    def pick(get):
        return torch.stack([get(parts[i])[r] for i, r in rows])

    batch = RolloutBatch(
        tokens=take("tokens", pad_id), mask=take("mask", 0.0), rollout_logp=take("rollout_logp", 0.0),
        prompt_lens=pick(lambda p: p[0].prompt_lens), response_lens=pick(lambda p: p[0].response_lens),
        finished=pick(lambda p: p[0].finished),
    )
    scores = Scores(
        rewards=pick(lambda p: p[1].rewards), correct=pick(lambda p: p[1].correct),
        invalid=pick(lambda p: p[1].invalid), errors=sum(p[1].errors for p in parts),
        trailing=None if parts[0][1].trailing is None else pick(lambda p: p[1].trailing),
        unclosed=None if parts[0][1].unclosed is None else pick(lambda p: p[1].unclosed),
    )
    return batch, scores, pick(lambda p: p[2]), pick(lambda p: p[3])


def _check_writable(out: Path) -> None:
    """Fail before any work when the output directory cannot be created or written."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_bytes(b"x" * 4096)
        probe.unlink()
    except OSError as e:
        raise ValueError(f"output_dir={str(out)!r} is not writable ({e.strerror}); choose a writable directory") from e

