"""The coordinator's pure security rules: API keys, request ids, limits, callback checks, ownership, redaction."""

import json

import pytest

from coordinator.api_keys import ApiKeys, parse_keys
from coordinator.attempts import AttemptRegistry
from coordinator.callback_checks import (
    block_count,
    callback_problem,
    handoff_params_problem,
    host_allowed,
    mint_token,
)
from coordinator.errors import OpenAIError
from coordinator.limits import (
    RequestLimits,
    check_body,
    check_context,
    check_prompt_size,
    json_depth,
    prompt_chars,
)
from coordinator.ownership import ownership_problem
from coordinator.redact import REDACTED, redact
from coordinator.request_ids import client_request_id, log_id, mint_request_id
from coordinator.understanding import parse_body
from tandem.config_file import ConfigError

# -- API keys -----------------------------------------------------------------------------------------------------


def test_api_keys_accept_only_bearer_of_a_configured_key():
    keys = ApiKeys(["k1", "k2"])
    assert keys.enabled and len(keys) == 2
    assert keys.accepts("Bearer k1") and keys.accepts("bearer k2") and keys.accepts("Bearer  k2 ")
    for bad in (None, "", "k1", "Basic k1", "Bearer", "Bearer k3", "Bearer k1x"):
        assert not keys.accepts(bad), bad


def test_no_keys_means_an_open_port():
    assert ApiKeys().accepts(None) and not ApiKeys().enabled


def test_keys_from_file_and_env(tmp_path, monkeypatch):
    path = tmp_path / "keys"
    path.write_text("# comment\nk1\n\n  k2  \n")
    monkeypatch.setenv("TANDEM_KEYS", "k3, k4,")
    keys = ApiKeys.load(str(path), "TANDEM_KEYS")
    assert all(keys.accepts(f"Bearer k{i}") for i in range(1, 5))
    assert parse_keys("a,,b", ",") == ["a", "b"]


def test_key_config_errors_name_the_key(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="api_keys_file"):
        ApiKeys.load(str(tmp_path / "missing"), None)
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ConfigError, match="holds no key"):
        ApiKeys.load(str(tmp_path / "empty"), None)
    monkeypatch.delenv("TANDEM_NO_SUCH", raising=False)
    with pytest.raises(ConfigError, match="api_keys_env"):
        ApiKeys.load(None, "TANDEM_NO_SUCH")


# -- request ids --------------------------------------------------------------------------------------------------


def test_minted_ids_are_fresh_and_client_ids_only_labels():
    assert len({mint_request_id() for _ in range(1000)}) == 1000
    assert (
        client_request_id("abc\r\nX-Evil: 1" + "x" * 500) == "abcX-Evil: 1" + "x" * 114
    )  # cut at 128, then CR/LF dropped
    assert client_request_id(None) == ""
    assert log_id("", "tdm-1") == "tdm-1" and log_id("c", "tdm-1") == "c>tdm-1"


def test_a_superseded_attempt_closing_twice_never_raises():
    """The old KeyError: two opens of one root id, then both closes (it ran before the workload release)."""
    registry = AttemptRegistry()
    first = registry.open("same", "completions", 1)
    second = registry.open("same", "completions", 1)
    assert second.number == 2 and second.engine_request_id != first.engine_request_id
    assert registry.close(first) is False  # already closed when superseded
    assert registry.close(second) is True
    third = registry.open("same", "completions", 1)
    assert registry.close(third) is True and len(registry) == 0


# -- limits -------------------------------------------------------------------------------------------------------

LIMITS = RequestLimits(
    max_tokens=100, max_n=2, max_best_of=3, max_logprobs=5, max_prompts=3, max_messages=4, max_json_depth=5
)


@pytest.mark.parametrize(
    ("api", "body", "param"),
    [
        ("completions", {"max_tokens": 101}, "max_tokens"),
        ("chat.completions", {"max_completion_tokens": 101}, "max_completion_tokens"),
        ("completions", {"n": 3}, "n"),
        ("completions", {"best_of": 4}, "best_of"),
        ("completions", {"prompt_logprobs": 6}, "prompt_logprobs"),
        ("chat.completions", {"prompt_logprobs": 10**6}, "prompt_logprobs"),
        ("completions", {"logprobs": 6}, "logprobs"),
        ("chat.completions", {"logprobs": True, "top_logprobs": 6}, "top_logprobs"),
        ("completions", {"prompt": ["a", "b", "c", "d"]}, "prompt"),
        ("chat.completions", {"messages": [{"role": "user"}] * 5}, "messages"),
        ("completions", {"x": [[[[[[1]]]]]]}, None),
    ],
)
def test_limits_refuse_with_400_naming_the_field(api, body, param):
    with pytest.raises(OpenAIError) as info:
        check_body(api, body, LIMITS)
    assert info.value.status == 400 and info.value.param == param


def test_within_limits_passes():
    check_body("completions", {"max_tokens": 100, "n": 2, "prompt": [1, 2, 3, 4, 5]}, LIMITS)  # token ids
    check_body("completions", {"best_of": 3, "logprobs": 5, "prompt_logprobs": 5}, LIMITS)
    check_body("chat.completions", {"logprobs": True, "top_logprobs": 5}, LIMITS)
    check_body("completions", {"prompt": ["a", "b", "c"], "x": [[[1]]]}, LIMITS)


def test_json_depth_is_iterative_and_bounded():
    deep = []
    for _ in range(10_000):
        deep = [deep]
    assert json_depth(deep, 5) == 6  # stops counting past the limit, no recursion
    assert json_depth({"a": [1, {"b": 2}]}, 10) == 3


def test_parser_recursion_is_a_400():
    with pytest.raises(OpenAIError) as info:
        parse_body(b"[" * 200_000 + b"]" * 200_000)
    assert info.value.status == 400


def test_context_limit():
    check_context([[1] * 10], 90, 100, "m")
    check_context([[1] * 10], 10**9, None, "m")  # unknown context: no check
    with pytest.raises(OpenAIError, match="max_model_len"):
        check_context([[1] * 10], 91, 100, "m")
    with pytest.raises(OpenAIError, match="prompt has 101"):
        check_context([[1] * 101], None, 100, "m")


# -- callback checks ----------------------------------------------------------------------------------------------

FACTS = {
    "remote_host": "10.0.0.5",
    "remote_port": 7000,
    "remote_block_ids": [[1, 2, 3]],
    "remote_block_size": [16],
}


def test_a_callback_needs_the_attempts_token():
    token = mint_token()
    assert callback_problem(token, token, FACTS, "10.0.0.5", 40, 16) is None
    for wrong in ("", "x", token[:-1]):
        assert "token" in callback_problem(token, wrong, FACTS, "10.0.0.5", 40, 16)


def test_a_callback_must_name_the_decode_instances_host():
    token = mint_token()
    problem = callback_problem(token, token, {**FACTS, "remote_host": "10.9.9.9"}, "10.0.0.5", 40, 16)
    assert "remote_host '10.9.9.9'" in problem
    assert (
        callback_problem(
            token, token, {**FACTS, "remote_host": "10.9.9.9"}, "10.0.0.5", 40, 16, ["10.9.0.0/16"]
        )
        is None
    )
    assert (
        host_allowed("127.0.0.1", "::1") and host_allowed("[::1]", "::1") and not host_allowed("", "10.0.0.5")
    )


def test_a_callback_must_fit_the_request():
    token = mint_token()
    assert "port" in callback_problem(token, token, {**FACTS, "remote_port": 70000}, "10.0.0.5", 40, 16)
    many = {**FACTS, "remote_block_ids": [list(range(10))]}
    assert "10 KV blocks" in callback_problem(
        token, token, many, "10.0.0.5", 40, 16
    )  # 40 tokens: 3 blocks (+1)
    assert block_count([[1, 2], [3]]) == 3 and block_count(None) == 0


# -- registry ownership -------------------------------------------------------------------------------------------


def test_ownership():
    assert ownership_problem(None, False, "n2", "n1") is None  # insecure mode: no identities
    assert ownership_problem("agent/n1", True, "n1", None) is None
    assert ownership_problem("agent/n1", True, "", "n1") is None
    assert "not of node 'n2'" in ownership_problem("agent/n1", True, "n2", None)
    assert "registered by the agent of node 'n1'" in ownership_problem("agent/n2", True, "", "n1")
    assert "not a node agent" in ownership_problem("operator", True, "", None)


# -- GetConfig redaction ------------------------------------------------------------------------------------------


def test_redaction_hides_env_keys_and_secret_flags():
    config = {
        "coordinator": {
            "api_keys_file": "/etc/keys",
            "api_keys_env": "KEYS",
            "max_tokens": 5,
            "tenants": [{"name": "gold", "keys": ["s6", "s7"], "tokens_per_minute": 100}],
        },
        "node_agents": [
            {
                "engines": [
                    {"env": {"HF_TOKEN": "s1"}, "args": ["--api-key", "s2", "--api-key=s3", "--port", "1"]},
                ],
                "kv_store": {"engine_env": {"X": "s4"}, "password": "s5"},
            }
        ],
    }
    text = json.dumps(redact(config))
    for secret in ("s1", "s2", "s3", "s4", "s5", "s6", "s7"):
        assert f'"{secret}"' not in text and f"={secret}" not in text
    assert "/etc/keys" in text and '"KEYS"' in text and '"max_tokens": 5' in text and REDACTED in text
    assert '"tokens_per_minute": 100' in text and '"name": "gold"' in text  # a tenant's limits stay visible
    assert config["node_agents"][0]["engines"][0]["env"] == {"HF_TOKEN": "s1"}  # a copy was redacted


# -- the trigger shell uses the checks ------------------------------------------------------------------------------


async def test_trigger_refuses_a_callback_without_the_attempts_token():
    from google.protobuf import struct_pb2

    from coordinator.attempts import PrefillLegFailed
    from coordinator.handoff import HandoffRunner
    from coordinator.trigger import CallbackRefused, TriggerCoordinator
    from tandem.v1 import metaserver_pb2
    from tests.helpers import pd_picker

    picker = pd_picker(["127.0.0.1:9"])
    runner = HandoffRunner(picker, 1.0, 1)
    trigger = TriggerCoordinator(runner, AttemptRegistry(), "https://127.0.0.1:9002/v1/metaserver/c0")
    decision = await picker.decide(
        "completions", json.dumps({"model": "m", "prompt": "a b c"}).encode(), "tdm-1"
    )
    attempt, body = trigger.open(decision, "/v1/completions")
    url = json.loads(body)["kv_transfer_params"]["metaserver"]
    assert url == f"https://127.0.0.1:9002/v1/metaserver/c0/{attempt.token}" and len(attempt.token) >= 24
    blocks = struct_pb2.ListValue()
    blocks.append([1])

    def request(token: str, host: str = "127.0.0.1") -> metaserver_pb2.TriggerRequest:
        return metaserver_pb2.TriggerRequest(
            request_id=attempt.expected[0],
            token=token,
            remote_host=host,
            remote_port=7000,
            remote_block_ids=blocks,
        )

    with pytest.raises(CallbackRefused, match="token"):
        await trigger.callback(request("forged"))
    with pytest.raises(CallbackRefused, match="remote_host"):
        await trigger.callback(request(attempt.token, "10.6.6.6"))
    with pytest.raises(PrefillLegFailed):  # accepted: the leg runs (and fails here: nothing listens)
        await trigger.callback(request(attempt.token))
    trigger.registry.close(attempt)
    picker.release(decision.target)
    await runner.close()


def test_prompts_far_beyond_the_context_are_refused_before_tokenizing():
    limits = RequestLimits(max_chars_per_token=4)
    assert prompt_chars("completions", {"prompt": ["ab", "c", [1, 2]]}) == 5
    chat = {"messages": [{"role": "user", "content": "abc"}, {"content": [{"type": "text", "text": "de"}]}]}
    assert prompt_chars("chat.completions", chat) == 5
    check_prompt_size("completions", {"prompt": "x" * 400}, 100, limits, "m")
    check_prompt_size("completions", {"prompt": "x" * 10**6}, None, limits, "m")  # no context known
    with pytest.raises(OpenAIError, match="max_model_len"):
        check_prompt_size("completions", {"prompt": "x" * 401}, 100, limits, "m")
    # Without a context length, the mesh-wide bound still holds (the default mesh's 20 MB prompts).
    bounded = RequestLimits(max_prompt_chars=1000)
    check_prompt_size("chat.completions", {"messages": [{"content": "x" * 1000}]}, None, bounded, "m")
    with pytest.raises(OpenAIError, match="max_prompt_chars") as info:
        check_prompt_size("chat.completions", {"messages": [{"content": "x" * 1001}]}, None, bounded, "m")
    assert info.value.status == 400 and info.value.param == "messages"


# -- KV block bounds from what the mesh knows (issue 23) -----------------------------------------------------------


def test_the_block_bound_ignores_the_callers_block_size_and_caps_groups():
    """A rogue decode engine announcing 1-token blocks (16x the blocks of a 16-token block size) or a dozen groups
    (12x) made the prefill engine push that much more; the bound now uses the registered block size."""
    token = mint_token()
    tiny = {**FACTS, "remote_block_ids": [list(range(40))], "remote_block_size": [1]}
    assert "40 KV blocks" in callback_problem(token, token, tiny, "10.0.0.5", 40, 16)
    groups = {**FACTS, "remote_block_ids": [[1, 2, 3]] * 12}
    assert "12 KV cache groups" in callback_problem(token, token, groups, "10.0.0.5", 40, 16)
    two = {**FACTS, "remote_block_ids": [[1, 2, 3], [4, 5, 6]]}  # full and sliding-window attention
    assert callback_problem(token, token, two, "10.0.0.5", 40, 16) is None


def test_handoff_params_must_name_the_prefill_instance():
    params = {"remote_host": "10.0.0.7", "remote_port": 5600, "remote_block_ids": [[1, 2, 3]]}
    assert handoff_params_problem(params, "10.0.0.7", 40, 16) is None
    assert handoff_params_problem({**params, "remote_port": 0}, "10.0.0.7", 40, 16) is None  # vLLM's "none"
    assert "remote_host '10.9.9.9'" in handoff_params_problem(
        {**params, "remote_host": "10.9.9.9"}, "10.0.0.7", 40, 16
    )
    assert (
        handoff_params_problem({**params, "remote_host": "10.9.9.9"}, "10.0.0.7", 40, 16, ["10.9.0.0/16"])
        is None
    )
    assert "port" in handoff_params_problem({**params, "remote_port": "x"}, "10.0.0.7", 40, 16)
    assert "KV blocks" in handoff_params_problem(
        {**params, "remote_block_ids": [list(range(99))]}, "10.0.0.7", 40, 16
    )
    assert handoff_params_problem({"do_remote_prefill": True}, "10.0.0.7", 40, 16) is None  # names nothing
