"""The conductor's facts about one instance's cached prefix, as scheduling reads them (pure).

Below both their users: the policies score on them (`coordinator.scheduling`), the predicted cache merges its
predictions into them (`coordinator.predicted_cache`, which a policy also uses), and the conductor's client builds
them from its answers (`coordinator.kv_match`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KvMatch:
    """The conductor's facts for one candidate: leading prompt blocks it holds, per medium, mutually exclusive."""

    npu_blocks: int = 0  # leading blocks held in accelerator memory
    cpu_blocks: int = 0  # the next leading blocks, held in host memory
    disk_blocks: int = 0  # the next leading blocks, held on disk
    block_size: int = 16  # tokens per block, the instance's own

    @property
    def matched_tokens(self) -> int:
        """`(npu + cpu + disk) * block_size`."""
        return (self.npu_blocks + self.cpu_blocks + self.disk_blocks) * self.block_size


NO_MATCH = KvMatch()
