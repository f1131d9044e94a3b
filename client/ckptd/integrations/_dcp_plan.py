"""CkptdSavePlanner: DCP's DefaultSavePlanner with its plans kept from save to save while the
state's structure does not change (ckptd.integrations.dcp uses it; pass `writer.planner`).

DCP plans every save from scratch: a local plan (one WriteItem per chunk), an all-gather of the
plans, their deduplication and a global plan with its metadata. With the tensors handed to
ckptd in shared memory, that planning was most of `dcp.save`'s stall at 1,000 tensors. This
planner (1) turns on DCP's own plan caching (`enable_plan_caching`: an unchanged local plan is
not sent, the coordinator reuses its global plan), under a key of its own rather than DCP's
per-class key, so two planners (two jobs) in one process never share plans; and (2) keeps its
local plan while the state's *structure* is unchanged (per key: the value's type, dtype, shape;
a DTensor's placements, mesh and local shape; a ShardedTensor's local shards), where DCP builds
it again before comparing; and (3) flattens a state of nested mappings in one walk, to DCP's
own result (DCP walks it twice, the second time for ShardedTensors to rewrite), leaving any
other state (lists, ShardedTensors) to DCP. Values never enter a plan, so they may change freely.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any, Hashable, Mapping

import torch
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed.checkpoint import _version, default_planner
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_local_save_plan
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

__all__ = ["CkptdSavePlanner"]

_COMPARE = getattr(default_planner, "_compare_save_plans")  # noqa: B009 - DCP's own comparison of two local plans (private)
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # exact types: subclasses (DTensor, ...) go through DCP's lookup


class CkptdSavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner (same arguments) with plan caching on and the local plan kept while
    the state's structure is unchanged. Use one planner per writer (per job) for every save;
    each planner's cached plans live in DCP's class-level caches under the planner's own key
    until `forget()`."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("enable_plan_caching", True)
        super().__init__(**kwargs)
        self._cached_plans_key = f"{type(self).__name__}-{id(self):x}"
        self._local: tuple[Hashable, SavePlan] | None = None
        self.local_plans_built = 0  # how many local plans were made from scratch (tests, benchmarks)

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: StorageMeta | None = None, is_coordinator: bool = False) -> None:
        """DCP's set_up_planner; a state of nested mappings whose leaves are neither lists nor
        ShardedTensors (nothing DCP's flattening rewrites) is flattened in one walk, to the same
        flat dict and mappings."""
        flat = _flat_mappings(state_dict) if self.flatten_state_dict and _version._derived_version is None else None
        if flat is None:
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
            return
        self.state_dict, self.mappings = flat
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        key = _structure(self.state_dict, self.is_coordinator)
        if key is not None and self._local is not None and self._local[0] == key:
            plan = self._local[1]
        else:
            plan = create_default_local_save_plan(self.state_dict, self.is_coordinator)
            if self.flatten_state_dict:
                plan = dataclasses.replace(plan, planner_data=self.mappings)
            self._local = None if key is None else (key, plan)
            self.local_plans_built += 1
        self.plan = plan
        if self._enable_plan_caching:
            cached = SavePlanner._cached_save_plan.get(self._cached_plans_key)
            if cached is not None and (cached is plan or _COMPARE(plan, cached)):
                return SavePlan([], usable=False)  # unchanged: the coordinator uses its cached global plan
            self._pending_local_plan = plan  # promoted by finish_plan once the global plan succeeded
        return plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        """DCP's resolve_data, with a plain tensor found by one dict lookup (DCP's checks of it
        cost as much as ckptd's copy of a small tensor)."""
        if write_item.type != WriteItemType.BYTE_IO:
            value = self.state_dict.get(write_item.index.fqn)
            if isinstance(value, torch.Tensor) and type(value) in _PLAIN and not any(write_item.index.offset or ()):
                return value
        resolved: torch.Tensor | io.BytesIO = super().resolve_data(write_item)
        return resolved

    def forget(self) -> None:
        """Drop this planner's plans from DCP's class-level caches (e.g. when its job ends)."""
        self._local = None
        for cache in (SavePlanner._cached_save_plan, SavePlanner._cached_all_plans, SavePlanner._cached_global_plan,
                      SavePlanner._cached_metadata, SavePlanner._cached_final_save_plan):
            cache.pop(self._cached_plans_key, None)


def _flat_mappings(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[str | int, ...]]] | None:
    """DCP's flatten_state_dict of a state of nested mappings with no list and no ShardedTensor
    in it, in the same order: {"a.b": leaf} and {"a.b": ("a", "b")}. None for any other state
    (and for a key that two paths flatten to: DCP's flattening raises its error)."""
    flat: dict[str, Any] = {}
    mappings: dict[str, tuple[str | int, ...]] = {}
    return (flat, mappings) if _flatten_into(flat, mappings, (), state_dict) else None


def _flatten_into(flat: dict[str, Any], mappings: dict[str, tuple[str | int, ...]], prefix: tuple[str, ...], node: Mapping[Any, Any]) -> bool:
    for key, value in node.items():
        path = (*prefix, key if type(key) is str else str(key))
        if type(value) not in _PLAIN:  # a plain tensor (nearly every leaf) is a leaf at once
            if isinstance(value, Mapping):
                if not _flatten_into(flat, mappings, path, value):
                    return False
                continue
            if isinstance(value, (list, ShardedTensor)):
                return False
        fqn = ".".join(path)
        if fqn in flat:
            return False
        flat[fqn] = value
        mappings[fqn] = path
    return True


def _structure(state_dict: dict[str, Any], is_coordinator: bool) -> Hashable | None:
    """What a local plan of the flattened `state_dict` depends on; None for a value whose write
    items DCP cannot be asked about cheaply (an object with its own __create_write_items__ other
    than a DTensor): such a state is planned every time."""
    parts: list[Hashable] = [is_coordinator]
    for fqn, value in state_dict.items():
        if type(value) in _PLAIN:  # nearly every value: no lookups
            parts.append((fqn, "t", value.dtype, value.shape, value.requires_grad, value.layout))
        elif isinstance(value, DTensor):
            local = value._local_tensor
            parts.append((fqn, "d", value.dtype, value.shape, tuple(value.placements), id(value.device_mesh),
                          value.device_mesh.get_coordinate() is not None, local.shape, value.requires_grad))
        elif isinstance(value, ShardedTensor):
            shards = tuple((tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes)) for s in value.local_shards())
            parts.append((fqn, "s", value.metadata().tensor_properties.dtype, tuple(value.size()), shards))
        elif hasattr(value, "__create_write_items__"):
            return None
        elif isinstance(value, torch.Tensor):
            parts.append((fqn, "t", value.dtype, value.shape, value.requires_grad, value.layout))
        else:
            parts.append((fqn, "b"))  # a bytes entry: its value is serialized at write time, not planned
    return tuple(parts)
