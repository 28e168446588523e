import json

import pytest

from coordinator.errors import OpenAIError
from coordinator.instances import Health
from tandem.tokenizer import load_tokenizer
from tests.helpers import make_picker


def body(**fields) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


async def test_decision_commits_prompt_plus_output_tokens():
    picker = make_picker()
    d = await picker.decide("completions", body(prompt="hello there world", max_tokens=10), "r1")
    prompt_len = len(load_tokenizer(None).encode("hello there world"))
    iid = d.target.instance.info.instance_id
    assert d.request.prompt_tokens == prompt_len
    assert (picker.ledger.prefill_tokens(iid), picker.ledger.decode_tokens(iid)) == (prompt_len, 10)
    assert picker.ledger.context_tokens(iid) == prompt_len + 10
    assert picker.release(d.target) is True and picker.release(d.target) is False
    assert picker.ledger.total_tokens == 0


async def test_completions_default_max_tokens_and_n_and_prompt_lists():
    picker = make_picker()
    d = await picker.decide("completions", body(prompt=["a b", "c d e"], n=2), "r")
    assert len(d.request.prompts) == 2
    assert d.request.max_tokens == 16 * 2 * 2  # vLLM's default 16, per prompt and choice


async def test_least_load_spreads_concurrent_requests():
    picker = make_picker()
    first = await picker.decide(
        "chat.completions", body(messages=[{"role": "user", "content": "x " * 200}]), "a"
    )
    second = await picker.decide("chat.completions", body(messages=[{"role": "user", "content": "y"}]), "b")
    assert first.target.instance.info.instance_id != second.target.instance.info.instance_id


@pytest.mark.parametrize(
    ("api", "raw", "status", "fragment"),
    [
        ("completions", b"{not json", 400, "not valid JSON"),
        ("completions", b"[1, 2]", 400, "JSON object"),
        ("completions", b"", 400, "empty"),
        ("completions", json.dumps({"prompt": "x"}).encode(), 400, "`model` is required"),
        ("completions", body(), 400, "`prompt` is required"),
        ("completions", body(prompt="x", max_tokens=0), 400, "max_tokens"),
        ("completions", body(prompt="x", stream="yes"), 400, "stream"),
        ("completions", body(prompt=[1, -5]), 400, "out of vocabulary"),
        ("chat.completions", body(messages=[]), 400, "messages"),
        ("chat.completions", body(messages=[{"content": "no role"}]), 400, "role"),
        ("completions", json.dumps({"model": "nope", "prompt": "x"}).encode(), 404, "`nope` does not exist"),
    ],
)
async def test_errors(api, raw, status, fragment):
    picker = make_picker()
    with pytest.raises(OpenAIError) as info:
        await picker.decide(api, raw, "r")
    assert info.value.status == status
    assert fragment in info.value.message
    error = json.loads(info.value.body())["error"]
    assert (
        error["code"] == status and error["message"] == info.value.message and error["type"].endswith("Error")
    )
    assert picker.ledger.total_requests == 0


async def test_no_routable_instance_is_503_and_known_model_stays_known():
    picker = make_picker(instances=2)
    picker.instances.get("i0").health = Health.UNHEALTHY
    picker.instances.get("i1").drained = True
    with pytest.raises(OpenAIError) as info:
        await picker.decide("completions", body(prompt="x"), "r")
    assert info.value.status == 503
    picker.instances.deregister("i0")
    picker.instances.deregister("i1")
    with pytest.raises(OpenAIError) as info:
        await picker.decide("completions", body(prompt="x"), "r")
    assert info.value.status == 503


async def test_drained_and_unhealthy_instances_get_nothing():
    picker = make_picker(policy="round_robin", instances=3)
    picker.instances.get("i0").drained = True
    picker.instances.get("i2").health = Health.UNHEALTHY
    picks = set()
    for i in range(6):
        picks.add(
            (await picker.decide("completions", body(prompt="x"), str(i))).target.instance.info.instance_id
        )
    assert picks == {"i1"}
