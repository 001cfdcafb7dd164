"""The shared contract: one set of sampling rules, checked against the widths of the wire's fields."""

import math

import pytest

from stepwire.contract import (
    CHAT_ROLES,
    InvalidRequestError,
    SamplingParams,
    as_proto,
    check_chat,
    check_priority,
    check_prompt,
    check_sampling,
)
from stepwire.internal import sampling_pb2

BAD = [
    ("seed", -1), ("seed", 10**23), ("seed", 2**64),
    ("stop_token_ids", (2**32,)), ("stop_token_ids", (-1,)),
    ("max_tokens", 0), ("max_tokens", 2**32), ("min_tokens", 2**32),
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -1.0), ("temperature", 1e39),
    ("top_p", math.nan), ("top_p", 0.0), ("top_p", -math.inf), ("top_p", 1.5),
    ("min_p", math.nan), ("min_p", 2.0),
    ("top_k", -2), ("top_k", 2**31),
    ("logprobs", -1), ("logprobs", 2**32),
    ("temperature", True), ("max_tokens", 3.0),
]


@pytest.mark.parametrize("field, value", BAD)
def test_a_value_that_does_not_fit_its_proto_field_is_refused_naming_the_field(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value}).validate()
    assert e.value.field == field


@pytest.mark.parametrize("field, value", [
    ("seed", 0), ("seed", 2**64 - 1), ("stop_token_ids", (2**32 - 1,)), ("max_tokens", 2**32 - 1),
    ("temperature", 0.0), ("top_p", 1.0), ("top_k", 0), ("top_k", -1), ("min_p", 1.0), ("logprobs", 0)])
def test_every_value_at_the_edge_of_its_field_is_accepted_and_survives_the_wire(field, value):
    sp = SamplingParams(**{field: value}).validate()
    msg = sampling_pb2.SamplingParams.FromString(sp.to_proto().SerializeToString())
    got = tuple(getattr(msg, field)) if field == "stop_token_ids" else getattr(msg, field)
    assert got == value


def test_the_proto_message_is_checked_by_the_same_rules_as_the_dataclass():
    ok = SamplingParams(max_tokens=8, temperature=0.5, seed=3).to_proto()
    check_sampling(ok)
    for field, value in [("temperature", math.nan), ("top_p", math.inf), ("max_tokens", 0), ("top_k", -5)]:
        msg = sampling_pb2.SamplingParams()
        msg.CopyFrom(ok)
        setattr(msg, field, value)
        with pytest.raises(InvalidRequestError) as e:
            check_sampling(msg)
        assert e.value.field == field


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(max_tokens=4, min_tokens=5).validate()
    assert e.value.field == "min_tokens"


def test_a_message_from_the_wire_is_passed_on_as_the_same_object():
    msg = SamplingParams(max_tokens=8).to_proto()
    assert as_proto(msg) is msg
    assert as_proto(SamplingParams(max_tokens=8)) == msg


@pytest.mark.parametrize("priority", [2**31, -(2**31) - 1, 10**23, 1.0, "1"])
def test_a_priority_outside_int32_is_refused(priority):
    with pytest.raises(InvalidRequestError) as e:
        check_priority(priority)
    assert e.value.field == "priority"


@pytest.mark.parametrize("ids", [[], [5, 100], [-1], [True], [1.0]])
def test_a_prompt_must_be_nonempty_ids_inside_the_vocabulary(ids):
    with pytest.raises(InvalidRequestError):
        check_prompt(ids, vocab_size=100)
    check_prompt([0, 99], vocab_size=100)


@pytest.mark.parametrize("messages", [[], [{"role": "wizard", "content": "hi"}], [{"content": "hi"}],
                                      [{"role": "user", "content": "a"}, {"role": "User", "content": "b"}]])
def test_a_chat_needs_messages_with_known_roles(messages):
    with pytest.raises(InvalidRequestError) as e:
        check_chat(messages)
    assert e.value.field.startswith("messages")
    check_chat([{"role": r, "content": "x"} for r in CHAT_ROLES])
