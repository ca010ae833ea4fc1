"""A device other than the CPU for tests on a machine without a GPU (tests/test_device.py).

Inside `fake_device()`, `torch.device("meta")` behaves as an accelerator that computes with
the CPU: a tensor moved there (`.to("meta")`, `module.to("meta")`, a factory given
`device="meta"`) is an `OnDevice`, a wrapper around a real CPU tensor whose `.device` says
meta. Every operation runs on the CPU tensors underneath, so values are real (`.item()`,
`.tolist()`, data-dependent control flow all work and give the CPU's results), while the
placement rules CUDA enforces are enforced:
  - an operation that mixes device tensors with CPU tensors raises, as on CUDA, except CPU
    0-dim tensors (CUDA's "CPU scalars") and the cross-device copies (`.to`, `copy_`,
    indexing with CPU indices);
  - in `strict` mode, copying a CPU tensor (other than a 0-dim one) to the device raises
    too: CUDA does it silently, at the cost of a host copy and a sync per call (and a CUDA
    graph that cannot be recorded): how a module kept out of the module tree shows up, whose
    buffers `.to(device)` never moved;
  - an operation on device tensors drawing from a CPU torch.Generator raises, as on CUDA.

Why not real meta tensors: they hold no data, so nothing past the first `.item()` runs
(DFlash's anchor count, every verification, every decoding loop), and copying a meta
tensor to the CPU fails where CUDA's copy succeeds (a draft initialised from a target
tensor). "meta" is the name because transformers handles it as a device type (its
`maybe_autocast` skips meta), which a made-up name would not get.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode

DEVICE = torch.device("meta")
aten = torch.ops.aten
# Operations CUDA runs with CPU tensors among device ones: copies across devices, and
# indexing with CPU index tensors (copied to the device first).
CROSS_DEVICE = {
    aten.copy_.default,
    aten._to_copy.default,
    aten.to.device,
    aten.to.dtype_layout,
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
}


class OnDevice(Tensor):
    """A CPU tensor `inner` that says it lives on DEVICE."""

    inner: Tensor

    @staticmethod
    def __new__(cls, cpu: Tensor):
        return Tensor._make_wrapper_subclass(
            cls, cpu.shape, strides=cpu.stride(), storage_offset=cpu.storage_offset(),
            dtype=cpu.dtype, layout=cpu.layout, device=DEVICE, requires_grad=False,
        )  # fmt: skip

    def __init__(self, cpu: Tensor):
        self.inner = cpu

    def __repr__(self) -> str:
        return f"OnDevice({self.inner!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} on an OnDevice tensor outside fake_device()")


def _leaves(xs) -> list:
    """The arguments of an operation, lists of tensors (cat, index) flattened."""
    return [y for x in xs for y in (_leaves(x) if isinstance(x, list | tuple) else (x,))]


def _map(fn, x):
    """fn over an operation's arguments or results: tensors, lists, tuples, return types
    (torch's own pytree does the same, several times slower)."""
    if isinstance(x, list | tuple):
        return type(x)([_map(fn, y) for y in x])
    return fn(x)


def _on_cpu(x):
    """An argument as the CPU runs it: the tensor under an OnDevice, the CPU for DEVICE."""
    if isinstance(x, OnDevice):
        return x.inner
    if isinstance(x, torch.device) and x.type == DEVICE.type:
        return torch.device("cpu")
    return x


def _is_device(device) -> bool:
    return device is not None and torch.device(device).type == DEVICE.type


class _Dispatch(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.strict = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = _leaves((*args, *kwargs.values()))
        on_device = [a for a in flat if isinstance(a, OnDevice)]
        on_cpu = [a for a in flat if isinstance(a, Tensor) and not isinstance(a, OnDevice)]
        real = [a for a in on_cpu if a.device.type != "cpu"]
        if real:
            raise RuntimeError(f"{func}: a real {real[0].device} tensor under fake_device()")
        devices = [a for a in flat if isinstance(a, torch.device)]  # where the result goes
        to_device = any(d.type == DEVICE.type for d in devices) if devices else bool(on_device)
        # CPU tensors other than 0-dim ones, read by an operation on the device
        host = [a for a in on_cpu if a.dim() > 0] if (on_device or to_device) else []
        d2h = func is aten.copy_.default and not isinstance(args[0], OnDevice)
        if host and not d2h:
            shapes = [tuple(a.shape) for a in host]
            if func not in CROSS_DEVICE:
                raise RuntimeError(
                    "Expected all tensors to be on the same device, but found at least two "
                    f"devices, {DEVICE} and cpu! ({func}: CPU tensors of shapes {shapes})"
                )
            if self.strict:
                raise RuntimeError(
                    f"a host-to-device copy inside a step ({func}: CPU tensors of shapes "
                    f"{shapes}): a tensor was left on the CPU"
                )
        generator = kwargs.get("generator")
        if on_device and generator is not None and generator.device.type == "cpu":
            raise RuntimeError(
                f"Expected a '{DEVICE.type}' device type for generator but found 'cpu' ({func})"
            )
        inner = {id(a.inner): a for a in on_device}
        inner_args = _map(_on_cpu, args)
        inner_kwargs = {key: _map(_on_cpu, value) for key, value in kwargs.items()}
        out = func(*inner_args, **inner_kwargs)
        if torch.Tag.inplace_view in func.tags:  # transpose_ & co: the wrapper's shape too
            with no_dispatch():
                func(*args, **kwargs)
        if not to_device:
            return out

        # A view of a normal tensor is a normal tensor, even made under inference_mode
        normal = func.is_view and not all(a.is_inference() for a in on_device)

        def wrap(t):  # an in-place result is the input it was written into
            if not isinstance(t, Tensor):
                return t
            if id(t) in inner:
                return inner[id(t)]
            with torch.inference_mode(False) if normal else nullcontext():
                return OnDevice(t)

        return _map(wrap, out)


class _Functions(TorchFunctionMode):
    """What never reaches _Dispatch: torch.tensor / torch.as_tensor with device=DEVICE (built
    on the CPU and wrapped; made from Python data, not from a CPU tensor, so not a
    host-to-device copy for `strict`), and `.tolist()` (a copy to the host, as on CUDA)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and _is_device(kwargs.get("device")):
            return OnDevice(func(*args, **{**kwargs, "device": "cpu"}))
        if func is Tensor.tolist and isinstance(args[0], OnDevice):
            return args[0].inner.tolist()
        return func(*args, **kwargs)


@contextmanager
def fake_device():
    """Yields a handle whose `strict()` context forbids host-to-device copies."""
    dispatch = _Dispatch()
    with _Functions(), dispatch:
        yield _Strict(dispatch)


class _Strict:
    def __init__(self, dispatch: _Dispatch):
        self.dispatch = dispatch

    @contextmanager
    def strict(self):
        before, self.dispatch.strict = self.dispatch.strict, True
        try:
            yield
        finally:
            self.dispatch.strict = before
