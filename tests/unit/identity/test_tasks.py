"""tasks.asks_for_side_task and identify's side_task on real clients' requests
(tests/bed/corpus) and on the task prompts other clients send. Fast: no server."""

from __future__ import annotations

import pytest
from agents import CLIENT_NAMES
from corpus import load

from slotkeeper.decisions import policy
from slotkeeper.identity.identity import identify
from slotkeeper.identity.tasks import asks_for_side_task

# OpenWebUI's task prompts (its default templates' openings), sent as one user message.
OPENWEBUI_TITLE = ("### Task:\nGenerate a concise, 3-5 word title with an emoji summarizing the "
                   "chat history.\n### Guidelines:\n- The title should clearly represent the "
                   "main theme.\n### Chat History:\n<chat_history>\nUSER: how do I use pytest "
                   "fixtures?\n</chat_history>")
OPENWEBUI_TAGS = ("### Task:\nGenerate 1-3 broad tags categorizing the main themes of the chat "
                  "history, along with 1-3 more specific subtopic tags.")
OPENWEBUI_FOLLOW_UPS = ("### Task:\nSuggest 3-5 relevant follow-up questions or prompts that "
                        "the user might naturally ask next in this conversation.")


def chat_body(messages: list[dict], **extra) -> dict:
    return {"model": "m", "messages": messages, **extra}


@pytest.mark.parametrize("client", CLIENT_NAMES)
def test_real_clients_side_requests_are_side_tasks_and_their_turns_are_not(client: str) -> None:
    for entry in load(client):
        found = identify(entry["path"], dict(entry["headers"]), entry["body"])
        assert found.side_task is (entry["kind"] == "side"), (client, entry["phase"],
                                                               entry["kind"])


@pytest.mark.parametrize("task", [OPENWEBUI_TITLE, OPENWEBUI_TAGS, OPENWEBUI_FOLLOW_UPS])
def test_a_chat_uis_task_in_the_user_message_is_a_side_task(task: str) -> None:
    body = chat_body([{"role": "user", "content": task}], chat_id="c-1")
    assert identify("/v1/chat/completions", {}, body).side_task


def test_a_chat_with_a_reply_is_never_a_side_task() -> None:
    """The same ask in a conversation's later turn: it is the conversation going on."""
    body = chat_body([{"role": "user", "content": "Generate a title for my essay on bees."},
                      {"role": "assistant", "content": "Bees at Work"},
                      {"role": "user", "content": "Generate a title that is shorter."}])
    assert not identify("/v1/chat/completions", {}, body).side_task


def test_a_request_with_tools_is_never_a_side_task() -> None:
    body = chat_body([{"role": "system", "content": "You are a title generator."},
                      {"role": "user", "content": "hi"}],
                     tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert not identify("/v1/chat/completions", {}, body).side_task


def test_only_the_head_of_a_long_system_prompt_is_read() -> None:
    """An agent's system prompt that mentions titles far down is not a title task."""
    system = "You are a helpful assistant. " * 40 + "Generate a title when asked."
    assert not asks_for_side_task(has_tools=False, roles=["user"], system_parts=[system],
                                  first_user_parts=["hello"])
    assert asks_for_side_task(has_tools=False, roles=["user"],
                              system_parts=["You are a ", "title generator."],
                              first_user_parts=["hello"])


def test_plain_questions_are_not_side_tasks() -> None:
    for text in ("What is the title of this book?", "Name three colours.",
                 "Write a function that parses titles."):
        assert not asks_for_side_task(has_tools=False, roles=["user"], system_parts=[],
                                      first_user_parts=[text]), text


def test_a_side_task_is_a_side_request_even_when_it_arrives_first() -> None:
    """OpenCode's title request can reach us before its conversation's first turn: with no
    resident conversation and a prompt above the small-request size it is still SIDE."""
    assert policy.classify(chain=("a", "b"), system_key="k", prompt_chars=5_000,
                           small_request_chars=2_000, resident=None,
                           own_request_running=False, side_task=True) == policy.SIDE
    assert policy.classify(chain=("a", "b"), system_key="k", prompt_chars=5_000,
                           small_request_chars=2_000, resident=None,
                           own_request_running=False) == policy.MAIN
