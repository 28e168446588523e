"""Adapter block hashes against real vLLM's: `tandem.chain_hash.adapter_root` partitions (tokens, adapter) exactly as
vLLM's own block hashes with their LoRA extra key do (`make test-vllm`: vLLM runs in its own venv)."""

from __future__ import annotations

import json
import random
import subprocess

from tandem.chain_hash import adapter_root, chain_hashes

BS = 4

#: Runs in vLLM's venv: each case's block hashes as vLLM computes them, with the extra keys vLLM's own
#: `_gen_lora_extra_hash_keys` gives a request of that adapter.
VLLM_HASHES = """
import json, sys
from types import SimpleNamespace
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core import kv_cache_utils as k

k.init_none_hash(sha256_cbor)
out = []
for tokens, adapter, bs in json.load(sys.stdin):
    lora = LoRARequest(adapter, 1 + hash(adapter) % 1000, "/adapters/" + adapter) if adapter else None
    extra = k._gen_lora_extra_hash_keys(SimpleNamespace(lora_request=lora))
    parent, hashes = None, []
    for i in range(len(tokens) // bs):
        parent = k.hash_block_tokens(sha256_cbor, parent, tokens[i * bs : (i + 1) * bs], tuple(extra) or None)
        hashes.append(bytes(parent).hex())
    out.append(hashes)
json.dump(out, sys.stdout)
"""


def test_adapter_chains_partition_blocks_as_vllms_hashes_do(vllm_python):
    rng = random.Random(26)
    cases = []
    for _ in range(60):  # few distinct tokens and shared prefixes, so that equal blocks are common
        prefix = [rng.choice((1, 2)) for _ in range(rng.choice((4, 8)))]
        tokens = prefix + [rng.choice((1, 2, 3)) for _ in range(rng.choice((0, 4, 8)))]
        cases.append((tokens, rng.choice(("", "sql", "chat")), BS))
    theirs = json.loads(
        subprocess.run(
            [vllm_python, "-c", VLLM_HASHES], input=json.dumps(cases), capture_output=True, text=True, check=True,
            timeout=120,
        ).stdout
    )  # fmt: skip
    ours = [chain_hashes(tokens, bs, parent=adapter_root(adapter)) for tokens, adapter, bs in cases]
    pairs = 0
    for i in range(len(cases)):
        for j in range(len(cases)):
            for b in range(min(len(ours[i]), len(ours[j]))):
                assert (ours[i][b] == ours[j][b]) == (theirs[i][b] == theirs[j][b]), (cases[i], cases[j], b)
                pairs += ours[i][b] == ours[j][b] and cases[i][1] == cases[j][1] and i != j
    assert pairs > 20  # the property was exercised on many equal blocks, not only on distinct ones
    # And never across adapters: the same tokens under two adapters (or an adapter and the base) differ.
    same_tokens = [(i, j) for i in range(len(cases)) for j in range(len(cases)) if cases[i][0] == cases[j][0]]
    assert any(cases[i][1] != cases[j][1] for i, j in same_tokens)
    for i, j in same_tokens:
        if cases[i][1] != cases[j][1] and ours[i]:
            assert ours[i][0] != ours[j][0] and theirs[i][0] != theirs[j][0]
