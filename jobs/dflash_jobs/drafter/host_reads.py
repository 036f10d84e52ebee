"""What a decoding loop reads back from the device, counted on any device: each read waits for every
kernel queued before it (a host sync), which at batch 1 leaves the GPU idle while the host catches up.

`HostReads` counts, while it is entered, the reads of a tensor's values by the host: `item()`,
`int()`/`float()`/`bool()` of a tensor, a 0-d tensor used as a Python index, `tolist()`/`numpy()`,
and the ops whose output size depends on the values (`nonzero` and the like). On a CPU those cost
nothing, but they are the same calls that wait on a GPU, so a count taken on a CPU is the count a
GPU run makes (a copy from pageable host memory to a GPU blocks too, and only CUDA's own sync debug
mode sees it: bench/evaluation/ counts those on the GPU). The benchmark and the tests share this one
definition of a read.
"""

from __future__ import annotations

from collections import Counter

from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

VALUE_READS = frozenset({"tolist", "numpy"})
"""Tensor methods that read every value to the host without going through an op."""
VALUE_OPS = frozenset({"aten.item.default", "aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
                             "aten._unique2.default", "aten.unique_consecutive.default", "aten.repeat_interleave.Tensor"})
"""Ops that read values to the host: a scalar read (item, int(), an index: `item` under inference mode,
`_local_scalar_dense` outside it), or an output sized by the values."""


class _Methods(TorchFunctionMode):
    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in VALUE_READS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


class _Ops(TorchDispatchMode):
    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.counts["ops"] += 1
        if name in VALUE_OPS:
            self.counts[name.removeprefix("aten.").removesuffix(".default")] += 1
        return func(*args, **(kwargs or {}))


class HostReads:
    """`with HostReads() as reads:` ... then `reads.total` host reads, `reads.ops` ops dispatched
    (each a kernel launch on a GPU, give or take fusion) and `reads.counts` by kind."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self._modes = (_Methods(self.counts), _Ops(self.counts))

    def __enter__(self) -> HostReads:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(count for kind, count in self.counts.items() if kind != "ops")

    @property
    def ops(self) -> int:
        return self.counts["ops"]
