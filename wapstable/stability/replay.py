"""Replay an anomaly checkpoint and localise the first NaN/Inf: the module and the op, in forward and in backward.

fairseq re-runs a bad batch with hooks that log the first module holding NaN/Inf; torch's `detect_anomaly` names
the backward op but checks NaN only (not Inf). One replay of the saved batch here records, in execution order:
- forward: the first module whose output is non-finite (forward hooks), the range of its inputs (the
  "z0 was 92" of an attention overflow), and the first aten op that turned finite inputs into NaN/Inf (a TorchDispatchMode sees every op,
  functional ones included, so `exp` is named even when it runs inside a module's forward);
- backward: the first module whose gradient turned non-finite (full backward hooks), and the first autograd node
  that produced NaN or Inf from finite incoming gradients (a hook on every node of the graph).
Every check is a host sync; this is a one-batch diagnosis, not something to leave on while training.
"""

import dataclasses
import math
import warnings
from collections.abc import Callable, Iterator

import torch
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException
from torch.utils._python_dispatch import TorchDispatchMode

from wapstable.checkpoint import rng_state, set_rng_state
from wapstable.config import checkpoint_config
from wapstable.errors import UserError
from wapstable.stability.guard import count_nonfinite_grads

# Ops whose output is uninitialised memory: NaN bits there are garbage, not a fault.
_UNINITIALISED = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_")


def _tensors(obj) -> Iterator[torch.Tensor]:
    """The floating-point tensors in a nested structure of tuples, lists, dicts and dataclasses."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() or obj.is_complex():
            yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors(v)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name))


def _kind(obj) -> str | None:
    """ "nan" if any tensor in `obj` holds NaN, else "inf" if any holds +-Inf, else None (all finite)."""
    kind = None
    for t in _tensors(obj):
        t = t.detach()
        if t.numel() and not bool(torch.isfinite(t).all()):
            if bool(torch.isnan(t).any()):
                return "nan"
            kind = "inf"
    return kind


def _stats(obj) -> dict:
    """min/max over the finite values (None when there is none) and the NaN and Inf counts, as Python numbers."""
    lo, hi, nan, inf = math.inf, -math.inf, 0, 0
    for t in _tensors(obj):
        t = t.detach()
        if not t.numel():
            continue
        if t.is_complex():
            t = torch.view_as_real(t)
        finite = torch.isfinite(t)
        nan += int(torch.isnan(t).sum())
        inf += int(torch.isinf(t).sum())
        if bool(finite.any()):
            vals = t[finite].float()
            lo, hi = min(lo, float(vals.min())), max(hi, float(vals.max()))
    if lo > hi:
        lo = hi = None
    return {"min": lo, "max": hi, "nan": nan, "inf": inf}


class _OpProbe(TorchDispatchMode):
    """Records the first aten op whose output is NaN/Inf while every tensor input was finite."""

    def __init__(self, module_stack: list[str]):
        super().__init__()
        self.module_stack = module_stack  # shared with the module hooks: which module is running now
        self.found: dict | None = None
        self.paused = False  # set while our own hooks compute statistics

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.found is not None or self.paused:
            return func(*args, **kwargs)
        # An in-place op overwrites its input, so the inputs are checked before it runs; otherwise after, and only
        # when the output is bad (most ops: one check).
        mutable = func._schema.is_mutable
        bad_in = _kind((args, kwargs)) if mutable else None
        in_stats = _stats((args, kwargs)) if mutable else None
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        kind = _kind(out)
        if kind and name not in _UNINITIALISED:
            if not mutable:
                bad_in, in_stats = _kind((args, kwargs)), None
            if bad_in is None:
                self.found = {
                    "op": str(func),
                    "module": self.module_stack[-1] if self.module_stack else None,
                    "kind": kind,
                    "inputs": in_stats or _stats((args, kwargs)),
                }
        return out


class _Recorder:
    """Hooks on every module and on every autograd node; keeps the first non-finite event of each kind."""

    def __init__(self, model: torch.nn.Module):
        self.stack: list[str] = []
        self.probe = _OpProbe(self.stack)
        self.handles = []
        self.forward_module: dict | None = None
        self.backward_origin: str | None = None  # finite gradient in, non-finite out
        self.backward_first: str | None = None  # any non-finite gradient, a fallback
        self.backward_op: dict | None = None
        self.last_output: dict[str, object] = {}
        self.param_names = {id(p): n for n, p in model.named_parameters()}
        self.first_bad_param: str | None = None
        root = type(model).__name__
        for name, m in model.named_modules():
            self.handles += [
                m.register_forward_pre_hook(self._pre(name or root)),
                m.register_forward_hook(self._post(name or root), with_kwargs=True),
            ]
            # Not the root: its gradient is just dL/d(output), bad whenever the forward was, and says nothing.
            if name:
                self.handles.append(m.register_full_backward_hook(self._backward(name)))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _pre(self, name: str):
        def hook(module, args):
            self.stack.append(name)

        return hook

    def _post(self, name: str):
        def hook(module, args, kwargs, output):
            if self.stack and self.stack[-1] == name:
                self.stack.pop()
            if self.forward_module is not None:
                return
            self.probe.paused = True
            try:
                kind = _kind(output)
                if kind:
                    self.forward_module = {
                        "name": name,
                        "kind": kind,
                        "inputs": _stats((args, kwargs)),
                        "output": _stats(output),
                    }
                    self.forward_module["energies"] = self._energies(module, name)
                elif name.rsplit(".", 1)[-1] == "v":  # an attention's energies, kept for _energies
                    self.last_output[name] = output
            finally:
                self.probe.paused = False

        return hook

    def _energies(self, module, name: str) -> dict | None:
        """The attention energies of the call that went bad: its `v` output times the fault's energy scale."""
        scale = getattr(module, "energy_scale", None)
        v_out = self.last_output.get(f"{name}.v")
        if scale is None or v_out is None:
            return None
        s = _stats(v_out)
        if s["min"] is None:
            return s
        lo, hi = sorted((s["min"] * scale, s["max"] * scale))
        return {**s, "min": lo, "max": hi, "scale": scale}

    def _backward(self, name: str):
        def hook(module, grad_input, grad_output):
            if self.backward_origin is not None:
                return
            bad_in = _kind(grad_input)
            if bad_in or _kind(grad_output):
                self.backward_first = self.backward_first or name
                if bad_in and not _kind(grad_output):
                    self.backward_origin = name

        return hook

    def hook_graph(self, loss: torch.Tensor) -> None:
        """A post-hook on every node reachable from the loss: they run in backward's execution order."""
        seen, todo = set(), [loss.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            self.handles.append(node.register_hook(self._node_hook(node)))
            todo.extend(n for n, _ in node.next_functions)

    def _node_hook(self, node):
        def hook(grad_inputs, grad_outputs):
            # grad_inputs: what the node produced (gradients of its forward inputs); grad_outputs: what it got.
            if self.backward_op is None:
                kind = _kind(grad_inputs)
                if kind and not _kind(grad_outputs):
                    self.backward_op = {"op": node.name(), "kind": kind}
            # The first parameter to receive a bad gradient: names a module when no module's inputs need grad.
            if self.first_bad_param is None and hasattr(node, "variable") and _kind(grad_outputs):
                self.first_bad_param = self.param_names.get(id(node.variable))

        return hook


def trace_nonfinite(model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor]) -> dict:
    """Run `loss_fn()` (forward) and its backward under the hooks; the localisation as a plain dict.

    `model` holds the modules to watch; the gradients are left in its parameters.
    """
    rec = _Recorder(model)
    model.zero_grad(set_to_none=True)
    try:
        # Off, whatever the caller set: anomaly mode would raise at the first NaN, before we have looked.
        with torch.autograd.set_detect_anomaly(False), warnings.catch_warnings():
            # A module none of whose inputs need grad (the first conv) fires on its output gradient: what we want.
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            with rec.probe:
                loss = loss_fn()
            rec.stack.clear()
            if loss.requires_grad:
                rec.hook_graph(loss)
                loss.backward()
    finally:
        rec.remove()
    loss_value = float(loss.detach().float())
    _, nonfinite_grads = count_nonfinite_grads(model.named_parameters())
    grads = [p.grad.detach().float() for p in model.parameters() if p.grad is not None]
    grad_norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0  # nan and inf pass through
    fm, fo = rec.forward_module or {}, rec.probe.found or {}
    owner = rec.first_bad_param.rpartition(".")[0] or None if rec.first_bad_param else None
    if fm or fo or not math.isfinite(loss_value):
        origin = "forward"
    elif rec.backward_op or nonfinite_grads:
        origin = "backward"
    else:
        origin = None
    return {
        "reproduced": not math.isfinite(loss_value) or bool(nonfinite_grads),
        "origin": origin,
        "loss": loss_value,
        "grad_norm": grad_norm,
        "first_forward_module": fm.get("name"),
        "first_forward_module_kind": fm.get("kind"),
        "first_forward_module_inputs": fm.get("inputs"),
        "first_forward_module_output": fm.get("output"),
        "attention_energies": fm.get("energies"),
        "first_forward_op": fo.get("op"),
        "first_forward_op_module": fo.get("module"),
        "first_forward_op_kind": fo.get("kind"),
        "first_forward_op_inputs": fo.get("inputs"),
        "first_backward_module": rec.backward_origin or rec.backward_first or owner,
        "first_backward_op": (rec.backward_op or {}).get("op"),
        "first_backward_op_kind": (rec.backward_op or {}).get("kind"),
        "nonfinite_grads": nonfinite_grads,
    }


def apply_overrides(config: dict, overrides: dict | None):
    """The run's config in this version's schema, with dotted-key overrides on top (each key must exist): the same
    merge as a resumed run's and scripts/evaluate.py's (`checkpoint_config`)."""
    overrides = overrides or {}
    source = OmegaConf.create()
    for key, value in overrides.items():
        OmegaConf.update(source, key, value)
    try:
        return checkpoint_config(config, list(overrides), source)
    except (ConfigKeyError, ConfigAttributeError) as e:
        key = next((k for k in overrides if k in str(e)), str(e).splitlines()[0])
        raise UserError(f"override {key}: the checkpoint's config has no key {key!r}") from None
    except OmegaConfBaseException as e:
        raise UserError(f"the anomaly checkpoint's config does not fit: {str(e).splitlines()[0]}") from None


def replay(state: dict, device="cpu", overrides: dict | None = None) -> dict:
    """Re-run the anomaly checkpoint's step (forward and backward on its batch, RNG and fault) and localise it.

    `state` is what `load_checkpoint` returns for `anomalies/step-N.pt`; `overrides` maps dotted config keys to
    values, e.g. {"model.attention.stable": True}, to check that a fix makes the anomaly go away.
    The caller's RNG state is left as it was.
    """
    from wapstable.data.batches import Batch
    from wapstable.device import resolve_device
    from wapstable.model.loss import forward_loss
    from wapstable.model.wap import build_model
    from wapstable.stability.faults import Fault

    if not isinstance(state, dict) or "anomaly" not in state:
        raise UserError(
            "this checkpoint has no 'anomaly' entry: it is a training checkpoint, not an anomaly checkpoint; "
            "replay a file from the run's anomalies/ folder"
        )
    for key in ("model", "config", "vocab", "rng"):
        if key not in state:
            raise UserError(f"this anomaly checkpoint lacks its {key!r} entry and cannot be replayed")
    anomaly = state["anomaly"]
    cfg = apply_overrides(state["config"], overrides)
    device = resolve_device(str(device))
    step = int(anomaly["step"])
    b = anomaly["batch"]
    batch = Batch(
        b["images"], b["image_mask"], b["targets"], b["target_mask"], list(b["ids"]), b.get("regions")
    ).to(device)
    # The batch is that of the rank that saw the anomaly (rank 0 without DDP): replay that rank's share of the fault.
    fault = Fault(cfg.fault, int(anomaly.get("batch_rank", 0)))
    precision = OmegaConf.select(cfg, "trainer.precision", default="32")

    caller_rng = rng_state()  # before build_model, whose initialisation draws from it
    try:
        model = build_model(cfg.model, len(state["vocab"])).to(device)
        model.load_state_dict(state["model"])
        model.train()  # as in training: dropout on, BatchNorm on batch statistics
        set_rng_state(state["rng"])  # the RNG as it was before the step's forward: same dropout masks
        model.scale_energies(fault.energy_scale(step))
        report = trace_nonfinite(model, lambda: forward_loss(model, batch, fault, step, precision))
        input_bad = int((~torch.isfinite(fault.batch(batch.images, step))).sum())
    finally:
        set_rng_state(caller_rng)
    return {
        "reproduced": report.pop("reproduced"),
        "step": step,
        "reason": anomaly.get("reason"),
        "saved_loss": anomaly.get("loss"),
        "saved_grad_norm": anomaly.get("grad_norm"),
        **report,
        "nonfinite_input_values": input_bad,
        "batch_ids": [str(i) for i in batch.ids],
        "overrides": {k: v for k, v in (overrides or {}).items()},
    }


def format_range(s: dict | None, counts: bool = False) -> str:
    """A tensor's figures (`_stats`) as its finite range `[min, max]`, and with `counts` its NaN and Inf counts."""
    if not s:
        return "n/a" if counts else "[no finite value]"
    finite = "[no finite value]" if s.get("min") is None else f"[{s['min']:.4g}, {s['max']:.4g}]"
    return f"{finite} (nan {s['nan']}, inf {s['inf']})" if counts else finite


def summarize(report: dict) -> str:
    """One or two lines: reproduced or not, and where the first NaN/Inf came from."""
    if not report["reproduced"]:
        return (
            f"not reproduced: loss {report['loss']:.4g} and every gradient finite on replay of step {report['step']} "
            f"(saved: {report['reason']}); a transient fault, or one the overrides fixed"
        )
    parts = []
    if report["first_forward_module"]:
        parts.append(
            f"first non-finite forward output in {report['first_forward_module']} "
            f"(inputs in {format_range(report['first_forward_module_inputs'])})"
        )
    if report["first_forward_op"]:
        where = report["first_forward_op_module"] or "outside the model"
        parts.append(
            f"forward op {report['first_forward_op']} in {where} produced {report['first_forward_op_kind']} "
            f"(inputs in {format_range(report['first_forward_op_inputs'])})"
        )
    elif report["nonfinite_input_values"]:
        parts.append(f"the input images hold {report['nonfinite_input_values']} non-finite values")
    if report["origin"] == "forward" and not parts:
        parts.append("the loss is non-finite in the forward pass, outside any module")
    if report["first_backward_module"]:
        parts.append(f"first non-finite gradient in {report['first_backward_module']}")
    if report["first_backward_op"]:
        note = " (downstream of the forward NaN/Inf)" if report["origin"] == "forward" else ""
        parts.append(
            f"backward op {report['first_backward_op']} produced {report['first_backward_op_kind']}{note}"
        )
    return f"reproduced, from the {report['origin']} pass: " + "; ".join(parts)
