"""The actor's layout-free checkpoint state (megatron ``dist_checkpointing``), for any TP/PP/DP on resume.

What is saved, and how it reshards:

- model weights: megatron's ``GPTModel.sharded_state_dict()`` (global tensor keys, layer index
  global, TP axis, swiglu fc1 split into gate/up, vocabulary padding absorbed by
  ``allow_shape_mismatch``);
- Adam moments ``exp_avg`` / ``exp_avg_sq`` of every parameter: sharded exactly like the parameter
  (``optimizer.state.<moment>.<parameter key>``), whichever optimizer wrote them. torch AdamW holds
  them per parameter already. megatron's distributed optimizer holds, on each DP rank, the moments of
  a contiguous range ``[start, end)`` of each flattened parameter; the save all-reduces (sum) a zero
  tensor of the parameter's size into which each DP rank wrote its range, i.e. the full moment; the
  load cuts each rank's range back out. So an AdamW checkpoint resumes with the distributed optimizer
  and vice versa, at any DP. The float32 main parameters of the distributed optimizer's non-float32
  parameters are saved the same way (``optimizer.state.main_param.<key>``), so BF16 rounding is not
  applied at a resume. Which parameters carry one is decided per parameter (:func:`_saves_main_param`)
  and recorded by key in the local state (``main_params``); the load asks for exactly those, so a model
  mixing BF16 and float32 parameters resumes too;
- the Adam step count (one per optimizer; every parameter has the same), in each rank's local state;
- the reference policy's weights (KL), as ``reference.<key>`` sharded like the model;
- FP8 delayed-scaling state of the emulated linears, in each rank's local state keyed by *global*
  layer number. Same layout: restored exactly. Changed TP/PP/DP: the histories of every saved shard of
  the same linear are merged - element-wise max of the amax histories, min of the scales. Going to a
  smaller TP this gives exactly the full-tensor amax a TP=1 run tracks (the amax of a tensor is the
  max of its shards' amaxes); going to a larger TP each shard starts from the full tensor's amax
  (conservative: no overflow).

TE's own FP8 metadata (GPU) travels in megatron's ``_extra_state`` objects of the TE modules, which
megatron shards per layer (layout-free).

Memory note: saving the distributed optimizer's moments materialises, one parameter at a time and
kept until the write ends, this rank's TP x PP shard of both moments in float32 (8 bytes/parameter);
only DP rank 0's copy is written.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from nemo_fp8rl.models.parallel import comm_device

LOCAL_FORMAT = "nemo_fp8rl.actor.sharded/1"
MOMENTS = ("exp_avg", "exp_avg_sq")


def _model_sharded(actor) -> dict:
    return actor.model.sharded_state_dict(prefix="")


def _param_to_sharded(model_sd: dict) -> dict[int, object]:
    """id(parameter) -> the ShardedTensor (or ShardedTensorFactory) that saves it."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    tensors, _ = extract_sharded_tensors_and_factories(model_sd)
    return {id(t.data): t for t in nested_values(tensors)}


def _like(sh, data: torch.Tensor, key_prefix: str):
    """A ShardedTensor/Factory saving ``data`` (shaped like the parameter) under ``key_prefix.<key>``."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    return make_sharded_optimizer_tensor(sh, data, prefix=key_prefix)


def _named_params(actor) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in actor.model.named_parameters() if p.requires_grad]


# ---------------------------------------------------------------- Adam state, per parameter
def _chained(actor) -> list:
    from nemo_fp8rl.models.optim import chained

    return chained(actor.optimizer)


def _adam_step(actor) -> Optional[int]:
    """The optimizer's step count (None before its first step); every parameter has the same."""
    steps = set()
    if actor.ddp is None:
        for st in actor.optimizer.state.values():
            if "step" in st:
                steps.add(int(st["step"]))
    else:
        from nemo_fp8rl.models.optim import chained

        for opt in chained(actor.optimizer):
            for st in opt.optimizer.state.values():
                if "step" in st:
                    steps.add(int(st["step"]))
            for group in opt.optimizer.param_groups:  # TE's FusedAdam (GPU) counts steps per group
                if group.get("step"):
                    steps.add(int(group["step"]))
    if len(steps) > 1:
        raise RuntimeError(f"optimizer parameters have different step counts {sorted(steps)}; cannot checkpoint")
    if steps:
        if dist.is_initialized() and dist.get_world_size() > 1:  # ranks without state (tiny DP shards)
            t = torch.tensor([max(steps)], dtype=torch.float64, device=comm_device())  # NCCL: not on the CPU
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return int(t.item())
        return steps.pop()
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([-1.0], dtype=torch.float64, device=comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return None if t.item() < 0 else int(t.item())
    return None


def _dist_opt_ranges(actor, p):
    """(optimizer, start, end, state dict) of the range ``[start, end)`` of flattened parameter p that
    this DP rank's distributed optimizer owns; ``(None, 0, 0, None)`` when it owns none of p."""
    from nemo_fp8rl.models.optim import chained

    for opt in chained(actor.optimizer):
        if p in opt.model_param_gbuf_map and p in opt.model_param_group_index_map:
            r = opt._get_model_param_range_map(p)["param"]
            return opt, r.start, r.end, opt._get_main_param_and_optimizer_states(p)
    return None, 0, 0, None


def _saves_main_param(actor, p) -> bool:
    """Whether parameter p is saved with its float32 main parameter: the distributed optimizer keeps a
    separate float32 copy of every non-float32 parameter (a float32 parameter is its own main
    parameter, so the model weights already hold it)."""
    return actor.ddp is not None and p.dtype != torch.float32


def _full_moments(actor, p) -> dict[str, torch.Tensor]:
    """This rank's TP-local moments (and main parameter, :func:`_saves_main_param`) of parameter p,
    float32, p's shape."""
    if actor.ddp is None:
        st = actor.optimizer.state[p]
        return {k: st[k] for k in MOMENTS}
    opt, start, end, tensors = _dist_opt_ranges(actor, p)
    keys = MOMENTS + (("main_param",) if _saves_main_param(actor, p) else ())
    out = {}
    for k in keys:
        full = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
        if tensors is not None and end > start:
            src = tensors["param" if k == "main_param" else k]
            full[start:end].copy_(src.detach().view(-1))
        if actor.dp_size > 1:
            dist.all_reduce(full, group=actor.dp_group)
        out[k] = full.view(p.shape)
    return out


def _init_dist_opt_state(actor) -> None:
    """Give every shard of a fresh distributed optimizer its Adam state tensors (then overwritten)."""
    from nemo_fp8rl.models.optim import chained

    for opt in chained(actor.optimizer):
        inner = opt.optimizer
        for g in inner.param_groups:
            for p in g["params"]:
                if p.numel() and p not in inner.state:
                    inner.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                      "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


# ---------------------------------------------------------------- FP8 state, by global layer
def _global_fp8_names(model) -> dict[str, str]:
    """Stage-local module name of every emulated FP8 linear -> ``L<global layer number>.<rest>``."""
    from nemo_fp8rl.fp8.megatron import _Fp8ParallelMixin

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, _Fp8ParallelMixin) and m.fp8_state is not None:
            parts = name.split(".")
            i = parts.index("layers")
            layer = model.decoder.layers[int(parts[i + 1])].layer_number  # 1-based, global
            out[name] = f"L{layer}." + ".".join(parts[i + 2:])
    return out


def _to_global(model, states: Optional[dict]) -> Optional[dict]:
    if states is None:
        return None
    names = _global_fp8_names(model)
    return {names[n]: v for n, v in states.items()}


def _merge_fp8(entries: list[dict]) -> dict:
    """Merge delayed-scaling states of several shards of one linear: max of amax histories, min of scales.

    Each entry is ``{role: {"amax_history": [H], "scale": []}}``.
    """
    out = {}
    for role in entries[0]:
        hist = torch.stack([e[role]["amax_history"].float() for e in entries]).amax(0)
        scale = torch.stack([e[role]["scale"].float().reshape(()) for e in entries]).amin(0)
        out[role] = {"amax_history": hist, "scale": scale}
    return out


def _fp8_for_this_rank(model, key: str, rank_states: list[dict], my_saved: Optional[dict]) -> Optional[dict]:
    """This rank's stage-local FP8 states (``key``: ``fp8`` or ``reference_fp8``) from the saved ranks'
    global-keyed ones: the saved rank at this rank's coordinates when the layout is unchanged
    (``my_saved``), else every saved shard of each linear merged (:func:`_merge_fp8`). None when the
    checkpoint has none (FP8 off, or no delayed scaling)."""
    names = _global_fp8_names(model)
    if my_saved is not None:
        pooled = {g: [v] for g, v in (my_saved.get(key) or {}).items()}
    else:
        pooled = {}
        for st in rank_states:
            for g, v in (st.get(key) or {}).items():
                pooled.setdefault(g, []).append(v)
    if not pooled:
        return None
    if any(g not in pooled for g in names.values()):
        _raise_fp8(names, pooled)
    return {n: pooled[g][0] if len(pooled[g]) == 1 else _merge_fp8(pooled[g]) for n, g in names.items()}


def _raise_fp8(names, saved):
    raise ValueError(
        f"FP8 state of {len(saved)} linears in the checkpoint does not cover this model's {len(names)} FP8 linears; "
        "resume with the same fp8 recipe and first_last_layers_bf16"
    )


# ---------------------------------------------------------------- save / load
def checkpoint_state(actor) -> tuple[dict, dict]:
    """``(sharded, local)``: the sharded state dict to save collectively with ``dist_checkpointing``
    and this rank's small local state (layout, FP8 scaling, Adam step). Collective over the world
    (the distributed optimizer's moments are all-reduced over DP)."""
    from nemo_fp8rl.fp8.megatron import fp8_states

    model_sd = _model_sharded(actor)
    sharded = {"model": model_sd}
    step = _adam_step(actor)
    main_keys = set()  # sharded keys of the parameters saved with a main parameter
    if step is not None:
        by_param = _param_to_sharded(model_sd)
        opt_sd = {}
        for name, p in _named_params(actor):
            for k, t in _full_moments(actor, p).items():
                opt_sd[f"{k}.{name}"] = _like(by_param[id(p)], t, f"optimizer.state.{k}")
                if k == "main_param":
                    main_keys.add(by_param[id(p)].key)
        sharded["optimizer"] = opt_sd
    if actor._reference is not None:
        by_param = _param_to_sharded(model_sd)
        sharded["reference"] = {
            name: _like(by_param[id(p)], actor._reference[name].to(p.device, p.dtype), "reference")
            for name, p in _named_params(actor)
        }
    local = {
        "format": LOCAL_FORMAT,
        "layout": actor._layout(),
        "coords": {"tp_rank": actor.tp_rank, "pp_rank": actor.pp_rank, "dp_rank": actor.dp_rank},
        "adam_step": step,
        "main_params": sorted(main_keys),
        "has_reference": actor._reference is not None,
        "fp8": _to_global(actor.model, fp8_states(actor.model)),
        "reference_fp8": _to_global(actor.model, actor._reference_fp8),
    }
    return sharded, local


def _main_param_keys(rank_states: list[dict]) -> Optional[set]:
    """The sharded keys of the parameters saved with a main parameter, over every saved rank (global
    keys: any layout reads them); None means every parameter. Checkpoints written before the keys were
    recorded stored one flag, true when any parameter was not float32; only those where every parameter
    was (BF16 TE models) could be loaded, so true reads as every parameter."""
    keys = set()
    for st in rank_states:
        saved = st.get("main_params")
        if saved is True:
            return None
        keys.update(saved or ())
    return keys


def _layout_key(layout: dict) -> tuple:
    return (layout["tp"], layout["pp"], layout.get("dp"))


def load_checkpoint(actor, rank_states: list[dict], load_sharded: Callable[[dict], dict]) -> None:
    """Restore the actor from a format-2 checkpoint saved at any TP/PP/DP layout (collective).

    ``rank_states``: every saved rank's local state (from :func:`checkpoint_state`);
    ``load_sharded(template)``: megatron's ``dist_checkpointing.load`` of a sharded template.

    Raises:
        ValueError: the FP8 recipe differs, or the states are not actor states.
    """
    from nemo_fp8rl.fp8.megatron import load_fp8_states

    for st in rank_states:
        if st.get("format") != LOCAL_FORMAT:
            raise ValueError(f"not an actor checkpoint state (format={st.get('format')!r}, expected {LOCAL_FORMAT!r})")
    saved0 = rank_states[0]
    mine = actor._layout()
    if saved0["layout"]["fp8"] != mine["fp8"]:
        raise ValueError(f"checkpoint FP8 recipe {saved0['layout']['fp8']!r} != this run's {mine['fp8']!r}; resume "
                         "with the same fp8 recipe")
    # The saved rank at this rank's coordinates, when the TP/PP layout (and world) is unchanged.
    same_layout = (len(rank_states) == (dist.get_world_size() if dist.is_initialized() else 1)
                   and saved0["layout"]["tp"] == mine["tp"] and saved0["layout"]["pp"] == mine["pp"])
    me = {"tp_rank": actor.tp_rank, "pp_rank": actor.pp_rank, "dp_rank": actor.dp_rank}
    my_saved = next((st for st in rank_states if st["coords"] == me), None) if same_layout else None

    model_sd = _model_sharded(actor)
    template = {"model": model_sd}
    step = saved0["adam_step"]
    params = _named_params(actor)
    by_param = _param_to_sharded(model_sd)
    moments = {}
    if step is not None:
        main_keys = _main_param_keys(rank_states)
        opt_t = {}
        for name, p in params:
            has_main = main_keys is None or by_param[id(p)].key in main_keys
            for k in MOMENTS + (("main_param",) if has_main else ()):
                t = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                moments[(name, k)] = t
                opt_t[f"{k}.{name}"] = _like(by_param[id(p)], t, f"optimizer.state.{k}")
        template["optimizer"] = opt_t
    if saved0.get("has_reference"):
        template["reference"] = {name: _like(by_param[id(p)], torch.empty_like(p), "reference") for name, p in params}
    loaded = load_sharded(template)

    actor.model.load_state_dict(loaded["model"])
    # Saved by a BF16 parameter with a float32 main parameter: a float32 parameter here takes the main
    # parameter (not its BF16 rounding).
    with torch.no_grad():
        for name, p in params:
            if p.dtype == torch.float32 and (name, "main_param") in moments:
                p.copy_(loaded["optimizer"][f"main_param.{name}"])
    if step is not None:
        _load_adam(actor, params, {(n, k): loaded["optimizer"][f"{k}.{n}"] for (n, k) in moments}, step)
    elif actor.ddp is not None:
        from nemo_fp8rl.models.optim import reload_main_params

        reload_main_params(actor.optimizer, actor.device)
    actor._reference = ({n: loaded["reference"][n].detach().to("cpu", copy=True) for n, _ in params}
                        if saved0.get("has_reference") else None)
    fp8 = _fp8_for_this_rank(actor.model, "fp8", rank_states, my_saved)
    if fp8 is not None:
        load_fp8_states(actor.model, fp8)
    actor._reference_fp8 = _fp8_for_this_rank(actor.model, "reference_fp8", rank_states, my_saved)


def _load_adam(actor, params, loaded: dict, step: int) -> None:
    """Put the loaded per-parameter moments into this run's optimizer (AdamW or this DP rank's ranges)."""
    if actor.ddp is None:
        sd = actor.optimizer.state_dict()
        index = {id(p): i for i, p in enumerate(p for g in actor.optimizer.param_groups for p in g["params"])}
        state = {}
        for name, p in params:
            # A separate step tensor per parameter (torch's AdamW increments each in place).
            state[index[id(p)]] = {"step": torch.tensor(float(step)),
                                   **{k: loaded[(name, k)].to(p.device, p.dtype) for k in MOMENTS}}
        sd["state"] = state
        actor.optimizer.load_state_dict(sd)
        return
    from nemo_fp8rl.models.optim import reload_main_params

    reload_main_params(actor.optimizer, actor.device)  # main params from the (just loaded) model params
    _init_dist_opt_state(actor)
    with torch.no_grad():
        for name, p in params:
            opt, start, end, tensors = _dist_opt_ranges(actor, p)
            if tensors is None or end <= start:
                continue
            for k in MOMENTS:
                tensors[k].view(-1).copy_(loaded[(name, k)].view(-1)[start:end])
            if (name, "main_param") in loaded and p.dtype != torch.float32:
                tensors["param"].view(-1).copy_(loaded[(name, "main_param")].view(-1)[start:end])
            main = tensors["param"]
            st = opt.optimizer.state[main]
            st["step"] = torch.tensor(float(step))  # one tensor per parameter, never shared
    for opt in _chained(actor):
        for group in opt.optimizer.param_groups:
            if "step" in group:  # TE's FusedAdam (GPU) keeps the step count per group
                group["step"] = step


__all__ = ["checkpoint_state", "load_checkpoint", "LOCAL_FORMAT"]
