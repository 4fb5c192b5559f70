"""LoraSlots: which LoRA adapter sits in which of the engine's `max_loras` weight slots. Torch-free.

An adapter is computed from a slot (worker/engine/lora.py stacks every slot's A and B per layer). A step needs a slot
for each adapter its rows use; `place` gives them one, taking a free slot or evicting the least recently used
adapter that no running request holds. The scheduler admits a request only while the running requests use at
most `max_loras` adapters (SchedulerConfig.max_loras), so a step's adapters always fit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class LoraSlots:
    """Adapter ids (ints > 0) -> slot indices in [0, capacity), least recently used first.

    Invariants (`check_invariants`): every slot holds at most one adapter; the placed adapters are at most
    `capacity`."""

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"max_loras must be a positive integer, got {capacity!r}")
        self.capacity = capacity
        self._slots: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot; first = least recently used

    def slot_of(self, lora_id: int) -> int | None:
        return self._slots.get(lora_id)

    @property
    def placed(self) -> tuple[int, ...]:
        """Adapter ids in slots, least recently used first."""
        return tuple(self._slots)

    def place(self, needed: Iterable[int], in_use: Iterable[int]) -> list[tuple[int, int]]:
        """Give every adapter of `needed` a slot (each marked most recently used) and return the (id, slot) pairs
        newly placed, whose weights the caller copies in. Evicts only adapters neither needed nor `in_use` (held
        by a running request); RuntimeError when that is not enough (the scheduler's bound prevents it)."""
        needed = list(dict.fromkeys(needed))
        keep = set(needed) | set(in_use)
        placed: list[tuple[int, int]] = []
        for lora_id in needed:
            if lora_id in self._slots:
                self._slots.move_to_end(lora_id)
                continue
            slot = self._free_slot(keep)
            self._slots[lora_id] = slot
            placed.append((lora_id, slot))
        return placed

    def _free_slot(self, keep: set[int]) -> int:
        taken = set(self._slots.values())
        for slot in range(self.capacity):
            if slot not in taken:
                return slot
        for lora_id in self._slots:
            if lora_id not in keep:
                return self._slots.pop(lora_id)
        raise RuntimeError(f"every one of the {self.capacity} LoRA slots (--max-loras) holds an adapter in use")

    def drop(self, lora_id: int) -> int | None:
        """Forget an adapter (unloaded); its slot, if it had one, is free again."""
        return self._slots.pop(lora_id, None)

    def check_invariants(self) -> None:
        slots = list(self._slots.values())
        if (
            len(slots) > self.capacity
            or len(set(slots)) != len(slots)
            or any(not 0 <= s < self.capacity for s in slots)
        ):
            raise ValueError(f"LoRA slots inconsistent: {dict(self._slots)} with capacity {self.capacity}")
