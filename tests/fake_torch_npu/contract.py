"""The fake's shared contract: the releases it plays, the limits several kernels check, and the strict
wrapper that binds each call to its documented signature and records it."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

COMPRESSED = 2048
NEW_VERSION, OLD_VERSION = "2.6.0", "2.1.0"
MAX_INT = 2147483647
LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
SPARSE_MODES = tuple(range(9))  # documented: 0 .. 8
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_CE_ROWS = 200_000  # npu_cross_entropy_loss: at most 200,000 rows
MAX_GMM_WEIGHTS = 128  # npu_grouped_matmul: at most 128 tensors in a list


@dataclass(frozen=True)
class Release:
    """What the played torch_npu (with its CANN) offers."""

    version: str = NEW_VERSION
    rotary_mode: bool = True  # npu_rotary_mul(..., rotary_mode=)
    group_type: bool = True  # npu_grouped_matmul(..., group_type=, group_list_type=)
    tnd: bool = True  # npu_fusion_attention's TND layout
    actual_seq: bool = True  # npu_fusion_attention(..., actual_seq_qlen=, actual_seq_kvlen=)
    group_type_2: bool = True  # group_type=2 accepted when called
    incre_attention: bool = True  # npu_incre_flash_attention (decoding) is there


OLD_APIS = {
    False: Release(),
    True: Release(OLD_VERSION, rotary_mode=False, group_type=False, tnd=False, actual_seq=False),
    "cann7.0": Release(OLD_VERSION, rotary_mode=False, group_type=False, tnd=False, actual_seq=False),
    "cann8.0.rc1": Release(actual_seq=False),
    "group_type_2_refused": Release(group_type_2=False),
    "no_incre_attention": Release(incre_attention=False),
}
GROUP_TYPE_2_REFUSAL = "group_type currently only support -1 and 0, current value is 2"


@dataclass
class Call:
    name: str
    args: tuple
    kwargs: dict[str, Any] = field(default_factory=dict)
    result: Any = None
    drawn: tuple = ()  # attention with dropout: the (seed, offset) drawn, kept even if the call stops early


def strict(npu, fn):
    """Wrap a fake kernel: bind the call to its documented signature (TypeError on anything else), record
    it as passed, run it, keep the result on the record."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def kernel(*args, **kwargs):
        signature.bind(*args, **kwargs)
        call = Call(fn.__name__, args, kwargs)
        npu.calls.append(call)
        call.result = fn(*args, **kwargs)
        return call.result

    return kernel
