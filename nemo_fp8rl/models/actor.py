"""``FP8Actor``: the policy as the RL trainer sees it (NeMo-Aligner's actor shape, NeMo RL's loss API).

The trainer never touches megatron. It calls:

- :meth:`FP8Actor.get_logprobs` / :meth:`~FP8Actor.get_shadow_logprobs` /
  :meth:`~FP8Actor.get_reference_logprobs`: forward-only passes through megatron's
  ``get_forward_backward_func`` over microbatches; per-token log-probs (and entropy) from
  vocab-parallel logits (:mod:`nemo_fp8rl.models.logprobs`), broadcast from the last pipeline stage;
- :meth:`FP8Actor.train_step`: forward/backward over microbatches with the loss on the last stage,
  gradient sync (DP, tied embeddings across PP, sequence-parallel norms), clipping, AdamW;
- :meth:`FP8Actor.export_weights` / :meth:`~FP8Actor.load_weights` (Hugging Face naming) and
  :meth:`~FP8Actor.state_dict_for_checkpoint` / :meth:`~FP8Actor.load_checkpoint_state`.

Loss normalisation (NeMo RL's convention). Megatron would divide each microbatch loss by the number
of microbatches and average gradients over data-parallel ranks. We instead set
``calculate_per_token_loss=True`` (megatron leaves the loss alone) and *sum* gradients over DP, so
the gradient is that of

    L = sum over DP ranks r, microbatches k of loss_fn(mb_{r,k}, ..., global_tokens=N_tok, global_seqs=N_seq)

where N_tok = sum of ``mask`` over the whole minibatch on all DP ranks and N_seq = number of sequences
with any masked token. A ``token-mean`` loss that divides its per-microbatch sum by N_tok therefore
gives the same L (and gradient) for any microbatch size and DP/TP/PP layout.

Optimizer (:mod:`nemo_fp8rl.models.optim`). ``distributed_optimizer=False``: ``torch.optim.AdamW``
on float32 parameters (on GPU float32 master weights with megatron's BF16 autocast), state replicated
over DP. ``distributed_optimizer=True``: megatron's ``DistributedDataParallel`` + distributed
optimizer (grads reduce-scattered over DP, Adam state and float32 main parameters sharded over DP;
BF16 parameters on GPU, float32 on CPU). Same update either way; weight decay on matrices only (not
norms or biases), as in megatron. docs/megatron.md has the memory arithmetic.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterator, Mapping, Optional

import torch
import torch.distributed as dist

from nemo_fp8rl.algorithms.metrics import Metric, make_metric, reduce_metrics
from nemo_fp8rl.config.model import ModelConfig, ParallelConfig
from nemo_fp8rl.fp8.linear import fp8_weight_cache
from nemo_fp8rl.models.cpu_schedules import cpu_pipeline_schedules
from nemo_fp8rl.models.gpt import build_gpt_model, resolve_model_fp8_backend
from nemo_fp8rl.models.hf_weights import (
    count_parameters,
    hf_names,
    init_hf_state_dict,
    iter_stage_hf,
    stage_hf_manifest,
    load_stage_hf,
    stage_hf_names,
)
from nemo_fp8rl.models import optim as _optim
from nemo_fp8rl.models.logprobs import token_logprobs_from_logits
from nemo_fp8rl.models.parallel import init_distributed, resolve_device

log = logging.getLogger(__name__)

LossFn = Callable[..., "tuple[torch.Tensor, dict[str, Metric]]"]
CHECKPOINT_FORMAT = "nemo_fp8rl.actor/1"


# Token multiple of an FP8 recipe on Transformer Engine (per rank: see token_pad_multiple)
_TE_FP8_TOKEN_MULTIPLE = {"blockwise": 128, "mxfp8": 32}
_TE_FP8_TOKEN_MULTIPLE_DEFAULT = 16


def token_pad_multiple(tp_size: int, sequence_parallel: bool, te_fp8_scaling: Optional[str]) -> int:
    """The multiple every microbatch's sequence length T is right-padded to before the forward.

    Sequence parallelism splits the T of a [T, b, h] activation over the TP ranks: T % tp == 0.
    FP8 on Transformer Engine (``te_fp8_scaling``: the recipe's scaling, None without TE FP8): TE's
    linears require the tokens of their input, prod(shape[:-1]) = (T / tp under SP, else T) * b, to be a
    multiple of 8 (``assert_dim_for_fp8_exec``); the wgrad GEMM reduces over those tokens, and FP8 GEMMs
    want that reduction dimension a multiple of 16, so the per-rank T is padded to m = 16 (NeMo RL's
    choice); m = 128 for ``blockwise`` (TE's 1x128 quantizer needs whole blocks of tokens to all-gather
    under SP in FP8, else it gathers in high precision with a warning) and m = 32 for ``mxfp8`` (TE
    2.8's MXFP8 tensors need both dims multiples of 32). Result: m * tp under SP, else m; without TE FP8
    tp under SP, else 1. Padding T (not b) keeps every microbatch, a short last one included, legal.
    """
    split = tp_size if sequence_parallel else 1
    if te_fp8_scaling is None:
        return split
    return _TE_FP8_TOKEN_MULTIPLE.get(te_fp8_scaling, _TE_FP8_TOKEN_MULTIPLE_DEFAULT) * split


def _split(batch: Mapping[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    """Split every tensor of ``batch`` ([B, ...]) into consecutive microbatches of ``size`` rows."""
    n = next(iter(batch.values())).shape[0]
    for k, v in batch.items():
        if v.shape[0] != n:
            raise ValueError(f"batch[{k!r}] has {v.shape[0]} rows, batch['tokens'] has {n}; all must match")
    return [{k: v[i:i + size] for k, v in batch.items()} for i in range(0, n, size)]


class FP8Actor:
    """A megatron GPT policy with emulated or TE FP8, its shadow/reference forwards and optimizer.

    Build with :func:`build_actor`. Every rank of the job holds one actor; all ranks of a model
    replica (its TP x PP ranks) must call each method together with the same data, and DP replicas
    call it with their own data.
    """

    def __init__(
        self,
        model,
        model_cfg: ModelConfig,
        parallel_cfg: ParallelConfig,
        *,
        fp8_recipe,
        use_te: bool,
        optimizer,
        grad_clip: float,
        fp8_report=None,
        ddp=None,
    ) -> None:
        from megatron.core import parallel_state as ps

        self.model = model
        self.model_cfg = model_cfg
        self.parallel_cfg = parallel_cfg
        self.fp8_recipe = fp8_recipe
        self.use_te = use_te
        # the GEMM backend of the FP8 linears: te (TE layers), else the report's emulate | torch
        self.fp8_backend = "te" if use_te else (fp8_report.backend if fp8_report is not None else "emulate")
        self.optimizer = optimizer
        self.ddp = ddp  # megatron DistributedDataParallel wrapper (distributed optimizer), else None
        self.grad_clip = grad_clip
        self.fp8_report = fp8_report
        self.device = next(model.parameters()).device
        self._ps = ps
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.mp_group = ps.get_model_parallel_group()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self._pp_last_global = ps.get_pipeline_model_parallel_last_rank()
        self._padded_vocab = model_cfg.padded_vocab(self.tp_size)
        self._reference: Optional[dict[str, torch.Tensor]] = None
        self._reference_fp8: Optional[dict] = None

    # ------------------------------------------------------------------ layout
    @property
    def tp_size(self) -> int:
        return self.parallel_cfg.tensor_model_parallel_size

    @property
    def pp_size(self) -> int:
        return self.parallel_cfg.pipeline_model_parallel_size

    @property
    def token_pad_multiple(self) -> int:
        """The multiple microbatch sequences are right-padded to (:func:`token_pad_multiple`)."""
        te_fp8 = self.fp8_recipe.scaling if (self.use_te and self.fp8_recipe is not None) else None
        return token_pad_multiple(self.tp_size, self.parallel_cfg.sequence_parallel, te_fp8)

    @property
    def dp_group(self):
        return self._ps.get_data_parallel_group()

    @property
    def dp_rank(self) -> int:
        return self._ps.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        return self._ps.get_data_parallel_world_size()

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def distributed_optimizer(self) -> bool:
        """True when megatron's DDP + distributed optimizer own the gradients and the Adam state."""
        return self.ddp is not None

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (Adam moments, step counters, float32 main-parameter
        copies; not the model parameters or gradients)."""
        if self.ddp is not None:
            return _optim.optimizer_state_bytes(self.optimizer)
        return _optim.adamw_state_bytes(self.optimizer)

    def num_parameters(self) -> int:
        """Parameters of the whole model (all TP shards and PP stages; vocabulary padding and a tied
        head excluded) - the count a Hugging Face checkpoint of it would have."""
        return count_parameters(self.model_cfg)

    # ------------------------------------------------------------------ schedule
    def _run_schedule(self, microbatches: list[dict], forward_only: bool, on_output: Callable, model=None) -> list:
        """Run megatron's forward(-backward) schedule; ``on_output(mb, output)`` is its loss function.
        ``model``: the module to run (default the bare GPT stage; the DDP wrapper for training)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        # Right-pad the sequence to what sequence parallelism and TE's FP8 GEMMs need (token_pad_multiple;
        # harmless under causal attention: no real token attends to a later position) and cut the logits
        # back to the real T before any log-prob or loss sees them, so padded positions never count.
        pad_to = self.token_pad_multiple

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            tokens = mb["tokens"]
            T = tokens.shape[1]
            extra = (-T) % pad_to
            if extra:
                tokens = torch.nn.functional.pad(tokens, (0, extra))
            pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
            out = model(tokens, pos, None)

            def loss_func(output):
                return on_output(mb, output[:, :T] if extra else output)

            return out, loss_func

        seq = max(mb["tokens"].shape[1] for mb in microbatches)
        seq += (-seq) % pad_to
        # one schedule = one set of weights (the optimizer steps after it): each FP8 weight is quantized
        # once for all its microbatches (Transformer Engine's first-microbatch caching)
        with cpu_pipeline_schedules(enabled=self.device.type == "cpu"), fp8_weight_cache(self.model):
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(microbatches),
                model=[self.model if model is None else model],
                num_microbatches=len(microbatches),
                seq_length=seq,
                micro_batch_size=self.parallel_cfg.micro_batch_size,
                forward_only=forward_only,
            )

    def _token_stats(self, output: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool):
        """logits [b, T, V_pad/tp] of this TP rank -> (logprobs [b, T], entropy [b, T] or None)."""
        vocab_per_rank = self._padded_vocab // self.tp_size
        return token_logprobs_from_logits(
            output, tokens, temperature=temperature, vocab_start=self.tp_rank * vocab_per_rank,
            vocab_size=self.model_cfg.vocab_size, group=self.tp_group if self.tp_size > 1 else None,
            with_entropy=with_entropy,
        )

    def _broadcast_from_last_stage(self, t: Optional[torch.Tensor], shape, dtype=torch.float32) -> torch.Tensor:
        if self.pp_size == 1:
            return t
        if t is None:
            t = torch.empty(shape, dtype=dtype, device=self.device)
        t = t.contiguous()
        dist.broadcast(t, src=self._pp_last_global, group=self.pp_group)
        return t

    # ------------------------------------------------------------------ log-probs
    @torch.no_grad()
    def _logprobs(self, tokens: torch.Tensor, temperature: float, with_entropy: bool):
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [B, T], got shape {tuple(tokens.shape)}")
        out_device = tokens.device
        tokens = tokens.to(self.device)
        mbs = _split({"tokens": tokens}, self.parallel_cfg.micro_batch_size)

        def collect(mb, output):
            lp, ent = self._token_stats(output, mb["tokens"], temperature, with_entropy)
            return output.new_zeros(()), {"logprobs": lp, "entropy": ent}

        store = self._run_schedule(mbs, True, collect)
        lp = ent = None
        if self.is_last_stage:
            lp = torch.cat([d["logprobs"] for d in store], 0)
            if with_entropy:
                ent = torch.cat([d["entropy"] for d in store], 0)
        lp = self._broadcast_from_last_stage(lp, tokens.shape)
        if with_entropy:
            ent = self._broadcast_from_last_stage(ent, tokens.shape)
        return lp.to(out_device), (ent.to(out_device) if with_entropy else None)

    def get_logprobs(self, tokens: torch.Tensor, *, temperature: float = 1.0, with_entropy: bool = False):
        """Per-token log-probs (and entropy) of ``tokens`` [B, T] under the policy as trained (FP8 on).

        ``logprobs[b, t] = log p(tokens[b, t] | tokens[b, :t])`` (column 0 = 0), float32 [B, T];
        entropy [B, T] of the distribution predicting token t, or None. Logits are divided by
        ``temperature`` first. No grad; returned on every rank of the model replica.
        """
        return self._logprobs(tokens, temperature, with_entropy)

    def get_shadow_logprobs(self, tokens: torch.Tensor, *, temperature: float = 1.0, with_entropy: bool = False):
        """:meth:`get_logprobs` with FP8 off (the BF16/high-precision shadow forward of the same weights)."""
        from nemo_fp8rl.fp8.megatron import fp8_disabled

        with fp8_disabled(self.model):
            return self._logprobs(tokens, temperature, with_entropy)

    def keep_reference(self) -> None:
        """Snapshot the current weights (and FP8 scaling state) on CPU as the reference policy."""
        from nemo_fp8rl.fp8.megatron import fp8_states

        self._reference = {n: p.detach().to("cpu", copy=True) for n, p in self.model.named_parameters()}
        self._reference_fp8 = fp8_states(self.model)

    @property
    def has_reference(self) -> bool:
        return self._reference is not None

    @contextlib.contextmanager
    def _weights_swapped(self, params: dict[str, torch.Tensor], fp8: Optional[dict]) -> Iterator[None]:
        """Swap ``params`` (and FP8 states) into the model for the block, then restore (NeMo-Aligner's
        CPU weight swap): the trained weights are stashed on CPU and copied back bit-exactly."""
        from nemo_fp8rl.fp8.megatron import fp8_states, load_fp8_states

        named = dict(self.model.named_parameters())
        stash = {n: p.detach().to("cpu", copy=True) for n, p in named.items()}
        stash_fp8 = fp8_states(self.model)
        try:
            with torch.no_grad():
                for n, p in named.items():
                    p.copy_(params[n])
            if fp8 is not None:
                load_fp8_states(self.model, fp8)
            yield
        finally:
            with torch.no_grad():
                for n, p in named.items():
                    p.copy_(stash[n])
            load_fp8_states(self.model, stash_fp8)

    def get_reference_logprobs(self, tokens: torch.Tensor, *, temperature: float = 1.0, with_entropy: bool = False,
                               high_precision: bool = False):
        """:meth:`get_logprobs` of the reference (initial) policy; ``high_precision`` also turns FP8 off.

        Raises:
            RuntimeError: the actor was built without ``keep_reference=True``.
        """
        if self._reference is None:
            raise RuntimeError(
                "no reference policy: build the actor with keep_reference=True (the trainer does this when "
                "the KL coefficient algorithm.kl_coef > 0)"
            )
        with self._weights_swapped(self._reference, self._reference_fp8):
            if high_precision:
                return self.get_shadow_logprobs(tokens, temperature=temperature, with_entropy=with_entropy)
            return self._logprobs(tokens, temperature, with_entropy)

    # ------------------------------------------------------------------ training
    def _sync_grads(self) -> None:
        """Sum gradients over DP; partial-sum replicated grads (QK norms, SP norms) over TP; tied embeddings over PP."""
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.dp_size > 1:
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for p in params:
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
            for grads in by_dtype.values():
                flat = _flatten_dense_tensors(grads)
                dist.all_reduce(flat, group=self.dp_group)
                for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                    g.copy_(synced)
        if self.tp_size > 1:
            # Replicated parameters that see only this rank's part of the work: QK-norm weights (each
            # rank normalises its own heads) and, under sequence parallelism, the norms (each rank
            # sees its sequence shard). Their gradients are partial sums (megatron's
            # _allreduce_non_tensor_model_parallel_grads).
            for name, p in self.model.named_parameters():
                if not p.requires_grad:
                    continue
                qk = self.model_cfg.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)
                sp = self.parallel_cfg.sequence_parallel and getattr(p, "sequence_parallel", False)
                if qk or sp:
                    dist.all_reduce(p.grad, group=self.tp_group)
        if self.pp_size > 1 and not self.model_cfg.untie_embeddings_and_output_weights:
            if self.is_first_stage or self.is_last_stage:
                w = self.model.embedding.word_embeddings.weight if self.is_first_stage else self.model.output_layer.weight
                dist.all_reduce(w.grad, group=self._ps.get_embedding_group())

    def _grad_norm(self) -> torch.Tensor:
        """Global gradient norm ``sqrt(sum_p sum_i g_{p,i}^2)`` over every parameter p of the model,
        each counted once: sharded parameters on every TP rank, TP-replicated ones on TP rank 0 only,
        the tied head copy of the last stage skipped; sum-of-squares all-reduced over TP x PP (float64).
        Returns a float32 0-dim tensor (identical on all ranks; DP ranks hold synced grads)."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.model.parameters():
            if p.grad is None or getattr(p, "shared", False):
                continue
            if param_is_not_tensor_parallel_duplicate(p):
                sq = sq + p.grad.detach().double().pow(2).sum()
        if self.tp_size * self.pp_size > 1:
            dist.all_reduce(sq, group=self.mp_group)
        return sq.sqrt().float()

    def broadcast_object_from_last_stage(self, obj):
        """``obj`` of the last pipeline stage, on every stage of this rank's pipeline (a collective of the
        pipeline group; a picklable object; other stages' ``obj`` is ignored). ``obj`` itself when PP = 1."""
        if self.pp_size == 1:
            return obj
        from nemo_fp8rl.models.parallel import comm_device

        payload = [obj]
        dist.broadcast_object_list(payload, src=self._pp_last_global, group=self.pp_group, device=comm_device())
        return payload[0]

    def _broadcast_metrics(self, metrics: Optional[dict[str, Metric]]) -> dict[str, Metric]:
        if self.pp_size == 1:
            return metrics
        obj = [{k: (v.detach().cpu(), r) for k, (v, r) in metrics.items()} if self.is_last_stage else None]
        dist.broadcast_object_list(obj, src=self._pp_last_global, group=self.pp_group)
        return {k: (v.to(self.device), r) for k, (v, r) in obj[0].items()}

    def train_step(
        self,
        batch: Mapping[str, torch.Tensor],
        loss_fn: LossFn,
        *,
        temperature: float = 1.0,
        skip_if_nonfinite: bool = True,
    ) -> dict[str, Metric]:
        """One optimizer step on one minibatch, split into microbatches of ``parallel.micro_batch_size``.

        Args:
            batch: tensors [B, ...]; needs ``tokens`` (long [B, T]) and ``mask`` (float [B, T], 1 on
                response tokens that count); every entry is sliced per microbatch for ``loss_fn``.
            loss_fn: ``loss_fn(mb, logprobs [b, T], entropy [b, T], *, global_tokens, global_seqs)
                -> (loss 0-dim, metrics dict[str, Metric])``, evaluated on the last pipeline stage.
            temperature: divides the logits before log_softmax (use the sampling temperature).
            skip_if_nonfinite: when the summed loss or the grad norm is inf/NaN, zero the grads and
                skip the optimizer step (``train/skipped`` = 1).

        Returns:
            Metrics reduced over microbatches and DP ranks, the same on every rank: the loss_fn's,
            ``train/loss`` (sum of microbatch losses over the minibatch and DP), ``train/grad_norm``
            (pre-clip global norm), ``train/skipped``, ``train/global_tokens``, ``train/global_seqs``.
        """
        if "tokens" not in batch or "mask" not in batch:
            raise ValueError(f"batch needs 'tokens' and 'mask'; got keys {sorted(batch)}")
        batch = {k: v.to(self.device) for k, v in batch.items()}
        mask = batch["mask"].float()
        counts = torch.stack([mask.sum(), (mask.sum(-1) > 0).sum().float()]).double()
        if self.dp_size > 1:
            dist.all_reduce(counts, group=self.dp_group)
        global_tokens, global_seqs = counts[0].float(), counts[1].float()

        def loss_on_output(mb, output):
            lp, ent = self._token_stats(output, mb["tokens"], temperature, True)
            loss, metrics = loss_fn(mb, lp, ent, global_tokens=global_tokens, global_seqs=global_seqs)
            if loss.dim() != 0:
                raise ValueError(f"loss_fn must return a 0-dim loss, got shape {tuple(loss.shape)}")
            metrics = dict(metrics)
            metrics["train/loss"] = make_metric(loss.detach(), "sum")
            return loss, torch.ones((), dtype=torch.int), metrics

        self.model.train()
        mbs = _split(batch, self.parallel_cfg.micro_batch_size)
        if self.ddp is not None:
            _optim.zero_grads(self.ddp, self.optimizer)
            store = self._run_schedule(mbs, False, loss_on_output, model=self.ddp)
            grad_norm = _optim.finish_grads(self.ddp, self.optimizer, self.device).to(self.device)
        else:
            self.optimizer.zero_grad(set_to_none=True)
            store = self._run_schedule(mbs, False, loss_on_output)
            self._sync_grads()
            grad_norm = self._grad_norm()

        metrics = reduce_metrics(store, group=self.dp_group if self.dp_size > 1 else None) if self.is_last_stage else None
        metrics = self._broadcast_metrics(metrics)
        loss_sum = metrics["train/loss"][0]
        finite = bool(torch.isfinite(loss_sum).item() and torch.isfinite(grad_norm).item())
        skipped = skip_if_nonfinite and not finite
        if skipped:
            log.warning("train_step: non-finite loss (%s) or grad norm (%s); update skipped",
                        float(loss_sum), float(grad_norm))
        elif self.ddp is not None:
            _optim.clip_and_step(self.optimizer, grad_norm, self.grad_clip, self.device)
        else:
            if self.grad_clip and self.grad_clip > 0:
                coeff = self.grad_clip / (grad_norm + 1e-6)
                if coeff < 1.0:
                    for p in self.model.parameters():
                        if p.grad is not None:
                            p.grad.mul_(coeff.to(p.grad.dtype))
            self.optimizer.step()
        if self.ddp is not None:
            _optim.zero_grads(self.ddp, self.optimizer)
        else:
            self.optimizer.zero_grad(set_to_none=True)
        metrics["train/grad_norm"] = make_metric(grad_norm, "max")
        metrics["train/skipped"] = make_metric(float(skipped), "max")
        metrics["train/global_tokens"] = make_metric(global_tokens, "max")
        metrics["train/global_seqs"] = make_metric(global_seqs, "max")
        return metrics

    def fp8_metrics(self, reset: bool = True) -> dict[str, Metric]:
        """FP8 health counters of the emulated linears since the last reset, summed over all ranks:
        ``fp8/saturated`` (values clamped to the format's max), ``fp8/quantized``,
        ``fp8/nonfinite_amax`` and ``fp8/saturation_frac`` = saturated / quantized. Collective over the
        world (every rank must call it). Empty counters on the TE path (TE does not expose them)."""
        from nemo_fp8rl.fp8 import collect_fp8_stats

        st = collect_fp8_stats(self.model, reset=reset)
        v = torch.stack([st["fp8/saturated"], st["fp8/quantized"], st["fp8/nonfinite_amax"]]).double().to(self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(v)
        return {
            "fp8/saturated": make_metric(v[0], "max"),
            "fp8/quantized": make_metric(v[1], "max"),
            "fp8/nonfinite_amax": make_metric(v[2], "max"),
            "fp8/saturation_frac": make_metric(v[0] / v[1].clamp(min=1), "max"),
        }

    # ------------------------------------------------------------------ weights
    def iter_weights(self, device: "str | torch.device" = "cpu",
                     dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """The full model in Hugging Face naming, one tensor at a time: ``(name, tensor)`` on ``device`` in
        ``dtype`` (float32 on the CPU by default: file writers, the vLLM sync) on every rank, stage by stage
        (embedding, layers in order, final norm, head). A colocated rollout engine asks for its own device
        and dtype (the GPU, BF16): no host round trip and no float32 copy.

        Each tensor is TP-gathered by its stage's ranks and, with pipeline stages, broadcast over the
        pipeline group in ``dtype`` when it is reached, so the extra memory is one tensor (and its TP
        parts), whatever the number of layers, as long as the consumer does not keep them. Each stage's
        list of names and shapes (:func:`~nemo_fp8rl.models.hf_weights.stage_hf_manifest`) is broadcast
        once, before its tensors: one host synchronisation per stage, none per tensor.
        Collective: every rank of the job must iterate it to the end, in step.
        """
        device = torch.device(device)
        tp_group = self.tp_group if self.tp_size > 1 else None
        if self.pp_size == 1:
            yield from iter_stage_hf(self.model, self.model_cfg, tp_group, device=device, dtype=dtype)
            return
        comm = torch.device(self.device)  # where the pipeline group's backend moves tensors
        for s, src in enumerate(dist.get_process_group_ranks(self.pp_group)):
            mine = s == self.pp_rank
            manifest = [stage_hf_manifest(self.model, self.model_cfg) if mine else None]
            dist.broadcast_object_list(manifest, src=src, group=self.pp_group)
            stream = iter_stage_hf(self.model, self.model_cfg, tp_group, device=comm, dtype=dtype) if mine else None
            for name, shape in manifest[0]:
                if stream is not None:
                    got, t = next(stream)
                    if got != name or tuple(t.shape) != tuple(shape):
                        raise RuntimeError(f"pipeline stage {s}'s weight stream sent {got} {tuple(t.shape)} where "
                                           f"its manifest says {name} {tuple(shape)}")
                else:
                    t = torch.empty(shape, dtype=dtype, device=comm)
                dist.broadcast(t, src=src, group=self.pp_group)
                yield name, t if t.device == device else t.to(device)
                del t
            if stream is not None and next(stream, None) is not None:
                raise RuntimeError(f"pipeline stage {s}'s weight stream has more tensors than its manifest")

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Full model in Hugging Face Llama/Qwen naming (TP-gathered, all PP stages), float32 CPU, on
        every rank: :meth:`iter_weights` collected. ``lm_head.weight`` is present also when tied (equal
        to the embedding)."""
        out = dict(self.iter_weights())
        if "lm_head.weight" not in out:
            out["lm_head.weight"] = out["model.embed_tokens.weight"].clone()
        return {n: out[n] for n in hf_names(self.model_cfg)}

    def load_weights(self, hf_state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load a Hugging Face-named state dict (the full model, on every rank); each rank copies its
        TP shard of its PP stage. Inverse of :meth:`export_weights`."""
        load_stage_hf(self.model, self.model_cfg, dict(hf_state_dict), self.tp_rank, self.tp_size)
        if self.ddp is not None:
            _optim.reload_main_params(self.optimizer, self.device)

    def sharded_checkpoint_state(self) -> tuple[dict, dict]:
        """``(sharded, local)`` for a layout-free checkpoint (:mod:`nemo_fp8rl.models.checkpointing`):
        megatron sharded tensors of the weights, Adam moments and reference weights (save them with
        ``dist_checkpointing``), and this rank's small local state (FP8 scaling by global layer, Adam
        step, layout). Collective over the world."""
        from nemo_fp8rl.models.checkpointing import checkpoint_state

        return checkpoint_state(self)

    def load_sharded_checkpoint(self, rank_states: list, load_sharded: Callable[[dict], dict]) -> None:
        """Inverse of :meth:`sharded_checkpoint_state`, from a checkpoint of any TP/PP/DP layout and
        either optimizer (``rank_states``: every saved rank's local state; ``load_sharded``: megatron's
        ``dist_checkpointing.load`` of a template). Collective over the world."""
        from nemo_fp8rl.models.checkpointing import load_checkpoint

        load_checkpoint(self, rank_states, load_sharded)

    def state_dict_for_checkpoint(self) -> dict:
        """This rank's model shard, optimizer state, FP8 scaling state and reference (torch objects):
        the per-rank (format 1) checkpoint, same TP/PP layout required on load (checked). The trainer
        writes :meth:`sharded_checkpoint_state` instead and reads both.
        """
        from nemo_fp8rl.fp8.megatron import fp8_states

        return {
            "format": CHECKPOINT_FORMAT,
            "layout": self._layout(),
            "model": self.model.state_dict(),
            "optimizer": _optim.shard_state_dict(self.optimizer) if self.ddp is not None else self.optimizer.state_dict(),
            "fp8": fp8_states(self.model),
            "reference": self._reference,
            "reference_fp8": self._reference_fp8,
        }

    def _layout(self) -> dict:
        layout = {"tp": self.tp_size, "pp": self.pp_size, "tp_rank": self.tp_rank, "pp_rank": self.pp_rank,
                  "fp8": self.fp8_recipe.name if self.fp8_recipe is not None else None}
        if self.ddp is not None:  # the Adam state is sharded over DP: the DP layout matters too
            layout.update(distributed_optimizer=True, dp=self.dp_size, dp_rank=self.dp_rank)
        return layout

    def load_checkpoint_state(self, sd: Mapping) -> None:
        """Inverse of :meth:`state_dict_for_checkpoint` (same layout and FP8 recipe required)."""
        from nemo_fp8rl.fp8.megatron import load_fp8_states

        if sd.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"not an actor checkpoint (format={sd.get('format')!r}, expected {CHECKPOINT_FORMAT!r})")
        mine, theirs = self._layout(), sd["layout"]
        if mine != theirs:
            raise ValueError(
                f"checkpoint layout {theirs} != this run's {mine}; resume with the same "
                "parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size, fp8 recipe and "
                "optim.distributed (or convert through export_weights/load_weights)"
            )
        self.model.load_state_dict(sd["model"])
        if self.ddp is not None:
            _optim.load_shard_state_dict(self.optimizer, sd["optimizer"])
        else:
            self.optimizer.load_state_dict(sd["optimizer"])
        load_fp8_states(self.model, sd["fp8"])
        self._reference = sd.get("reference")
        self._reference_fp8 = sd.get("reference_fp8")


def _param_groups(model, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.dim() < 2 or name.endswith(".bias") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_actor(
    model_cfg: ModelConfig,
    parallel_cfg: ParallelConfig,
    *,
    fp8_recipe=None,
    seed: int,
    lr: float,
    weight_decay: float = 0.0,
    adam_betas=(0.9, 0.999),
    adam_eps: float = 1e-8,
    grad_clip: float = 1.0,
    keep_reference: bool = False,
    use_te: Optional[bool] = None,
    device: "str | torch.device | None" = None,
    distributed_optimizer: Optional[bool] = None,
    fp8_backend: Optional[str] = None,
    fp8_auto_tokens: Optional[int] = None,
) -> FP8Actor:
    """Initialise distributed state, build this rank's GPT stage, initialise weights, build the optimizer.

    Weights: :func:`~nemo_fp8rl.models.hf_weights.init_hf_state_dict` (seeded per tensor name,
    layout-independent) loaded through :meth:`FP8Actor.load_weights`.

    Args:
        fp8_recipe: an :class:`~nemo_fp8rl.fp8.Fp8Recipe` or None (high precision).
        use_te: None = Transformer Engine spec when CUDA + TE are available, else our linears.
        fp8_backend: ``fp8.backend``: None (auto: te, else torch on an FP8 GPU, else emulate) | emulate |
            torch | te (:func:`~nemo_fp8rl.models.gpt.resolve_model_fp8_backend`); ``auto`` = None.
        fp8_auto_tokens: with ``fp8_backend`` None/auto, the rows of one micro-batch: on a GPU's torch backend a
            linear that measured slower in FP8 than BF16 at that size stays high precision (``fp8/layer_filter.py``).
        keep_reference: keep the initial weights on CPU for :meth:`FP8Actor.get_reference_logprobs`.
        device: None = CUDA when available, else CPU; ``"cpu"`` runs the CPU path on a GPU machine.
        distributed_optimizer: megatron's DDP + distributed optimizer (Adam state sharded over DP; BF16
            parameters with float32 main parameters on GPU, float32 parameters on CPU) instead of torch
            AdamW; None = True for a CUDA model, False on CPU (:mod:`nemo_fp8rl.models.optim`).
    """
    import dataclasses

    from megatron.core import parallel_state as ps

    if model_cfg.hf_path:
        raise ValueError(
            f"model.hf_path={model_cfg.hf_path!r}: build_actor does not read checkpoints; build with "
            "model.hf_path=null and pass the Hugging Face state dict to actor.load_weights()"
        )
    if lr <= 0:
        raise ValueError(f"lr={lr} must be > 0")
    device = resolve_device(device)
    distributed_optimizer = _optim.resolve_distributed(distributed_optimizer, device)
    # BF16 parameters exist only where the optimizer keeps float32 main parameters: megatron's distributed
    # optimizer on GPU (below, whatever params_dtype says). The 8B/32B launcher stages ask for bfloat16.
    bf16_params = distributed_optimizer and device.type == "cuda"
    if model_cfg.params_dtype not in (("float32", "bfloat16") if bf16_params else ("float32",)):
        raise ValueError(
            f"model.params_dtype={model_cfg.params_dtype}: the actor keeps float32 master weights; BF16 "
            "parameters (with float32 main parameters in the optimizer) need a GPU and optim.distributed=true "
            f"(here: device {device.type}, optim.distributed={distributed_optimizer}); otherwise set "
            "model.params_dtype=float32 (BF16 compute on GPU comes from autocast, FP8 from the recipe)"
        )
    init_distributed(parallel_cfg, model_cfg, device=device)
    auto = fp8_backend in (None, "auto") and use_te is None  # fp8.backend=auto: keep slow layers BF16
    fp8_backend = resolve_model_fp8_backend(fp8_backend, use_te, device)
    use_te = fp8_backend == "te"
    if device.type == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        # Megatron's TP-aware CUDA RNG tracker (TE modules and megatron's GPU init draw from it).
        model_parallel_cuda_manual_seed(seed)
    # Megatron's own (layout-dependent, overwritten below) CPU initialisation draws from the global
    # RNG: fork it so building an actor leaves the caller's random stream untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # GPU + distributed optimizer: BF16 parameters, float32 main parameters inside the optimizer.
        build_cfg = model_cfg
        if distributed_optimizer and device.type == "cuda":
            build_cfg = dataclasses.replace(model_cfg, params_dtype="bfloat16")
        model, report = build_gpt_model(build_cfg, parallel_cfg, fp8_recipe=fp8_recipe, fp8_backend=fp8_backend,
                                        device=device, fp8_auto_tokens=fp8_auto_tokens if auto else None)
    device = next(model.parameters()).device
    init = init_hf_state_dict(model_cfg, seed, stage_hf_names(model, model_cfg), device=device)
    load_stage_hf(model, model_cfg, init, ps.get_tensor_model_parallel_rank(),
                  parallel_cfg.tensor_model_parallel_size)
    del init
    ddp = None
    if distributed_optimizer:
        ddp, optimizer = _optim.build_distributed_optimizer(
            model, lr=lr, weight_decay=weight_decay, adam_betas=adam_betas, adam_eps=adam_eps,
            grad_clip=grad_clip, device=device)
    else:
        optimizer = torch.optim.AdamW(
            _param_groups(model, weight_decay), lr=lr, betas=tuple(adam_betas), eps=adam_eps, foreach=False
        )
    actor = FP8Actor(model, model_cfg, parallel_cfg, fp8_recipe=fp8_recipe, use_te=use_te,
                     optimizer=optimizer, grad_clip=grad_clip, fp8_report=report, ddp=ddp)
    if keep_reference:
        actor.keep_reference()
    return actor


__all__ = ["FP8Actor", "build_actor", "CHECKPOINT_FORMAT"]
