"""A stand-in ``torch`` for the kernel worker: tensors with shapes, strides and dtypes, no data.

The ahead-of-time compile only needs what Triton's binder reads from a tensor argument — its
``dtype`` (the pointer type) and ``data_ptr() % 16`` (the alignment specialisation) — plus
the integers vLLM's launchers compute from shapes and strides. Real torch would cost a
~200 MB CPU wheel from the PyTorch index (or a ~2.5 GB CUDA build from PyPI) for tensors
whose bytes nothing reads. So the worker registers this module as ``torch`` before vLLM's
launcher modules and Triton import it, and the launchers run on these tensors unchanged.

The semantics that reach a kernel argument follow torch exactly: contiguous strides, views
keep strides and offsets (slicing, ``view``, ``expand`` gives stride 0, ``.T``), every other
operation returns a fresh contiguous tensor of torch's result shape and promoted dtype, and
every allocation starts 256-byte aligned as torch's allocators do (a view's ``data_ptr``
adds its offset). ``tests/triton/test_standin_torch.py`` checks that the worker's kernels
get the same Triton cache keys with this module as with real torch.

Anything vLLM calls that is not here fails loudly (AttributeError), never silently: the build
then reports the launch as not compiled.

Loaded by ``kiln/triton/worker.py`` by file path; imports nothing from kiln.
"""

from __future__ import annotations

import builtins
import itertools
import math
from collections import namedtuple


class dtype:  # noqa: N801 (torch's name)
    def __init__(self, name: str, itemsize: int, rank: int, is_floating_point: bool):
        self.name, self.itemsize, self.rank, self.is_floating_point = name, itemsize, rank, is_floating_point

    def __repr__(self) -> str:
        return f"torch.{self.name}"  # Triton reads the part after the last dot

    __str__ = __repr__


# rank orders promotion: an integer tensor with a float operand becomes float32 (torch's default)
bool = dtype("bool", 1, 0, False)  # noqa: A001 (torch's names)
uint8, int8, int16 = dtype("uint8", 1, 1, False), dtype("int8", 1, 1, False), dtype("int16", 2, 2, False)
int32, int64 = dtype("int32", 4, 3, False), dtype("int64", 8, 4, False)
float8_e4m3fn, float8_e5m2 = dtype("float8_e4m3fn", 1, 5, True), dtype("float8_e5m2", 1, 5, True)
float8_e4m3fnuz, float8_e5m2fnuz = dtype("float8_e4m3fnuz", 1, 5, True), dtype("float8_e5m2fnuz", 1, 5, True)
float16, bfloat16 = dtype("float16", 2, 6, True), dtype("bfloat16", 2, 6, True)
float32, float64 = dtype("float32", 4, 7, True), dtype("float64", 8, 8, True)
# torch's aliases; from here on ``float``/``int``/``bool`` are dtypes (Python's via ``builtins``)
half, float, double, long, int = float16, float32, float64, int64, int32  # noqa: A001
_DEFAULT = float32
_ALIGN = 256
_next_address = itertools.count(1)


class device:  # noqa: N801
    def __init__(self, spec: str | device = "cpu", index: int | None = None):
        text = spec.type if isinstance(spec, device) else str(spec)
        self.type, _, number = text.partition(":")
        self.index = index if index is not None else (builtins.int(number) if number else None)

    def __repr__(self) -> str:
        return f"device(type='{self.type}'" + (f", index={self.index})" if self.index is not None else ")")


class Size(tuple):
    def numel(self) -> int:
        return math.prod(self)


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _sizes(args) -> tuple:
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        args = args[0]
    return tuple(operator_index(a) for a in args)


def operator_index(value) -> int:
    return value.__index__()


def _promote(a: dtype, b) -> dtype:
    if isinstance(b, Tensor):
        b = b.dtype
    elif isinstance(b, builtins.float):
        return a if a.is_floating_point else _DEFAULT
    else:  # a Python int or bool keeps the tensor's dtype
        return a
    if a is b:
        return a
    if a.rank == b.rank == 6:  # float16 with bfloat16
        return float32
    return a if a.rank >= b.rank else b


def _broadcast(a: tuple, b: tuple) -> tuple:
    out = []
    for x, y in itertools.zip_longest(reversed(a), reversed(b), fillvalue=1):
        if x != y and 1 not in (x, y):
            raise RuntimeError(f"shapes {list(a)} and {list(b)} do not broadcast")
        out.append(y if x == 1 else x)
    return tuple(reversed(out))


class Tensor:
    """Shape, strides, storage offset and dtype of a tensor whose bytes do not exist."""

    def __init__(self, shape, dtype: dtype = _DEFAULT, strides=None, offset: int = 0, dev: device | None = None,
                 base: int | None = None):
        self._shape = Size(shape)
        self._strides = tuple(strides) if strides is not None else _contiguous_strides(shape)
        self._offset = offset
        self.dtype = dtype
        self.device = dev or device("cpu")
        self._base = base if base is not None else next(_next_address) * (1 << 20) * _ALIGN

    # -- what Triton and the launchers read ------------------------------------------------
    @property
    def shape(self) -> Size:
        return self._shape

    def size(self, dim: int | None = None):
        return self._shape if dim is None else self._shape[dim]

    def stride(self, dim: int | None = None):
        return self._strides if dim is None else self._strides[dim]

    def dim(self) -> int:
        return len(self._shape)

    ndim = property(dim)

    def numel(self) -> int:
        return math.prod(self._shape)

    def element_size(self) -> int:
        return self.dtype.itemsize

    def storage_offset(self) -> int:
        return self._offset

    def data_ptr(self) -> int:
        return self._base + self._offset * self.dtype.itemsize

    def is_contiguous(self) -> bool:
        expected = _contiguous_strides(self._shape)
        return all(s == e or n == 1 for s, e, n in zip(self._strides, expected, self._shape, strict=True))

    def __len__(self) -> int:
        return self._shape[0]

    def __repr__(self) -> str:
        return f"standin.Tensor(shape={list(self._shape)}, dtype={self.dtype}, strides={list(self._strides)})"

    # -- views: same storage, torch's strides ----------------------------------------------
    def _view(self, shape, strides, offset: int | None = None) -> Tensor:
        return Tensor(shape, self.dtype, strides, self._offset if offset is None else offset, self.device, self._base)

    def _resolve(self, shape: tuple) -> tuple:
        if shape.count(-1) > 1:
            raise RuntimeError("only one dimension can be inferred")
        known = math.prod(s for s in shape if s != -1)
        if -1 in shape:
            shape = tuple(self.numel() // known if s == -1 else s for s in shape)
        if math.prod(shape) != self.numel():
            raise RuntimeError(f"shape {list(shape)} is invalid for input of size {self.numel()}")
        return shape

    def view(self, *shape) -> Tensor:
        if len(shape) == 1 and isinstance(shape[0], dtype):
            if shape[0].itemsize != self.dtype.itemsize:
                raise NotImplementedError("view as a dtype of another size")
            return Tensor(self._shape, shape[0], self._strides, self._offset, self.device, self._base)
        if not self.is_contiguous():
            raise RuntimeError("view size is not compatible with input tensor's size and stride")
        shape = self._resolve(_sizes(shape))
        return self._view(shape, _contiguous_strides(shape))

    def reshape(self, *shape) -> Tensor:
        return (self if self.is_contiguous() else self.contiguous()).view(*shape)

    def contiguous(self) -> Tensor:
        return self if self.is_contiguous() else self._new(self._shape)

    def expand(self, *sizes) -> Tensor:
        sizes = _sizes(sizes)
        lead = len(sizes) - self.dim()
        shape, strides = [], []
        for i, size in enumerate(sizes):
            old = self._shape[i - lead] if i >= lead else 1
            stride = self._strides[i - lead] if i >= lead else 0
            size = old if size == -1 else size
            if old != size:
                if old != 1:
                    raise RuntimeError(f"cannot expand size {old} to {size}")
                stride = 0
            shape.append(size)
            strides.append(stride)
        return self._view(shape, strides)

    def transpose(self, a: int, b: int) -> Tensor:
        shape, strides = list(self._shape), list(self._strides)
        shape[a], shape[b] = shape[b], shape[a]
        strides[a], strides[b] = strides[b], strides[a]
        return self._view(shape, strides)

    def t(self) -> Tensor:
        return self.transpose(0, 1)

    T = property(lambda self: self._view(self._shape[::-1], self._strides[::-1]))

    def squeeze(self, dim: int | None = None) -> Tensor:
        dims = range(self.dim()) if dim is None else [dim % self.dim()]
        keep = [i for i in range(self.dim()) if not (i in dims and self._shape[i] == 1)]
        return self._view([self._shape[i] for i in keep], [self._strides[i] for i in keep])

    def unsqueeze(self, dim: int) -> Tensor:
        dim = dim % (self.dim() + 1)
        shape, strides = list(self._shape), list(self._strides)
        inner = strides[dim] * shape[dim] if dim < len(shape) else 1
        shape.insert(dim, 1)
        strides.insert(dim, inner)
        return self._view(shape, strides)

    def __getitem__(self, index) -> Tensor:
        index = index if isinstance(index, tuple) else (index,)
        if Ellipsis in index:
            at = index.index(Ellipsis)
            fill = self.dim() - (len(index) - 1 - index.count(None))
            index = index[:at] + (slice(None),) * fill + index[at + 1:]
        shape, strides, offset, dim = [], [], self._offset, 0
        for item in index:
            if item is None:
                shape.append(1)
                strides.append(0)
                continue
            size, stride = self._shape[dim], self._strides[dim]
            if isinstance(item, slice):
                start, stop, step = item.indices(size)
                shape.append(max(0, (stop - start + step - 1) // step))
                strides.append(stride * step)
                offset += start * stride
            else:
                position = operator_index(item)
                offset += (position + size if position < 0 else position) * stride
            dim += 1
        shape += self._shape[dim:]
        strides += self._strides[dim:]
        return self._view(shape, strides, offset)

    # -- everything else: a fresh contiguous tensor ------------------------------------------
    def _new(self, shape, dtype: dtype | None = None) -> Tensor:
        return Tensor(tuple(shape), dtype or self.dtype, dev=self.device)

    def to(self, *args, **kwargs) -> Tensor:
        target = kwargs.get("dtype") or next((a for a in args if isinstance(a, dtype)), None)
        if target is None or target is self.dtype:
            return self
        return self._new(self._shape, target)

    def float(self) -> Tensor:
        return self.to(float32)

    def half(self) -> Tensor:
        return self.to(float16)

    def clone(self) -> Tensor:
        return self._new(self._shape)

    def _binary(self, other) -> Tensor:
        shape = _broadcast(self._shape, other._shape) if isinstance(other, Tensor) else self._shape
        return self._new(shape, _promote(self.dtype, other))

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _binary
    __and__ = __rand__ = __or__ = __ror__ = __rshift__ = __lshift__ = _binary

    def __truediv__(self, other) -> Tensor:
        result = self._binary(other)
        return result if result.dtype.is_floating_point else result.to(_DEFAULT)

    __rtruediv__ = __truediv__

    def __neg__(self) -> Tensor:
        return self._new(self._shape)

    def __matmul__(self, other: Tensor) -> Tensor:
        if other.dim() != 2 or self._shape[-1] != other._shape[0]:
            raise RuntimeError(f"matmul of {list(self._shape)} and {list(other._shape)}")
        return self._new(self._shape[:-1] + (other._shape[1],), _promote(self.dtype, other))

    def _reduce(self, dim=None, keepdim: bool = False, dtype: dtype | None = None) -> Tensor:
        if dim is None:
            return self._new((), dtype)
        dims = {d % self.dim() for d in (dim if isinstance(dim, (tuple, list)) else (dim,))}
        shape = [1 if i in dims else s for i, s in enumerate(self._shape) if keepdim or i not in dims]
        return self._new(shape, dtype)

    def norm(self, p=2, dim=None, keepdim: bool = False) -> Tensor:
        return self._reduce(dim, keepdim, self.dtype if self.dtype.is_floating_point else _DEFAULT)

    def sum(self, dim=None, keepdim: bool = False) -> Tensor:
        return self._reduce(dim, keepdim)

    amax = max = min = amin = mean = sum

    def sort(self, dim: int = -1, descending: bool = False):
        return _SortResult(self._new(self._shape), self._new(self._shape, int64))

    def zero_(self) -> Tensor:
        return self

    def fill_(self, value) -> Tensor:
        return self

    copy_ = fill_


_SortResult = namedtuple("sort", ["values", "indices"])


def _factory(shape, dtype, dev) -> Tensor:
    return Tensor(shape, dtype or _DEFAULT, dev=dev if isinstance(dev, device) else device(dev or "cpu"))


def empty(*size, dtype: dtype | None = None, device=None, **_) -> Tensor:
    return _factory(_sizes(size), dtype, device)


zeros = ones = empty


def full(size, fill_value, dtype: dtype | None = None, device=None, **_) -> Tensor:
    return _factory(_sizes((size,)), dtype, device)


def eye(n: int, m: int | None = None, dtype: dtype | None = None, device=None, **_) -> Tensor:
    return _factory((n, n if m is None else m), dtype, device)


def linspace(start, end, steps: int, dtype: dtype | None = None, device=None, **_) -> Tensor:
    return _factory((steps,), dtype, device)


def arange(*bounds, dtype: dtype | None = None, device=None, **_) -> Tensor:
    start, stop, step = (0, bounds[0], 1) if len(bounds) == 1 else (bounds + (1,))[:3]
    return _factory((max(0, math.ceil((stop - start) / step)),), dtype or int64, device)


def tensor(data, dtype: dtype | None = None, device=None, **_) -> Tensor:
    shape = () if not isinstance(data, (list, tuple)) else (len(data),)
    return _factory(shape, dtype, device)


def empty_like(other: Tensor, dtype: dtype | None = None, **_) -> Tensor:
    return other._new(other.shape, dtype)


zeros_like = ones_like = empty_like


class _NoCuda:
    """``torch.cuda`` on a machine with no GPU: vLLM's launchers only ask when told it is CUDA."""

    @staticmethod
    def is_available() -> bool:
        return False

    @staticmethod
    def device_count() -> int:
        return 0


cuda = _NoCuda()
__version__ = "0.0.0+kiln.standin"
