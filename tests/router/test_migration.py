"""StreamProgress: what the client has received of a stream, and the resume request built from it."""
from __future__ import annotations

import copy

from shardserve.router.migration import StreamProgress, sse


def completion_chunk(text: str, ids: list[int] | None, rid: str = "cmpl-1", created: int = 10,
                     finish: str | None = None) -> dict:
    choice = {"index": 0, "text": text, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    return {"id": rid, "created": created, "choices": [choice]}


def chat_chunk(content: str | None, ids: list[int], rid: str = "chat-1", role: str | None = None) -> dict:
    delta = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    return {"id": rid, "created": 5, "choices": [{"index": 0, "delta": delta, "token_ids": ids, "finish_reason": None}]}


def test_completion_chunks_record_ids_and_characters_and_strip_ids_the_client_did_not_ask_for():
    progress = StreamProgress.for_request("completion", {"prompt": "hi"})
    out = progress.observe(completion_chunk("Hello", [5, 6]))
    progress.observe(completion_chunk(" wörld", [7], finish="length"))
    assert progress.token_ids == [5, 6, 7] and progress.num_text_chars == len("Hello wörld")
    assert "token_ids" not in out["choices"][0] and progress.finished


def test_token_ids_stay_when_the_client_asked_for_them():
    progress = StreamProgress.for_request("completion", {"return_token_ids": True})
    out = progress.observe(completion_chunk("a", [1]))
    assert out["choices"][0]["token_ids"] == [1] and progress.token_ids == [1]


def test_chat_chunks_count_the_delta_content():
    progress = StreamProgress.for_request("chat", {"messages": []})
    progress.observe(chat_chunk(None, [], role="assistant"))  # the role chunk: no text, no token
    progress.observe(chat_chunk("Bon", [11]))
    progress.observe(chat_chunk("jour", [12, 13]))
    assert progress.token_ids == [11, 12, 13] and progress.num_text_chars == len("Bonjour") and not progress.finished


def test_the_echoed_prompt_is_not_output():
    progress = StreamProgress.for_request("completion", {"prompt": "Say hi", "echo": True})
    progress.observe(completion_chunk("Say hi", None))  # the echo chunk: the prompt, no token ids
    progress.observe(completion_chunk(" hi", [3]))
    assert progress.token_ids == [3] and progress.num_text_chars == len(" hi")


def test_an_echo_request_whose_first_chunk_is_output_counts_it():
    progress = StreamProgress.for_request("completion", {"echo": True})
    progress.observe(completion_chunk("x", [1]))
    progress.observe(completion_chunk("", None))  # later chunks without ids are no echo
    assert progress.token_ids == [1] and progress.num_text_chars == 1


def test_the_first_replicas_id_and_created_are_kept():
    progress = StreamProgress.for_request("completion", {})
    progress.observe(completion_chunk("a", [1], rid="cmpl-first", created=100))
    resumed = progress.observe(completion_chunk("b", [2], rid="cmpl-second", created=200))
    assert (resumed["id"], resumed["created"]) == ("cmpl-first", 100)


def test_next_body_asks_for_token_ids_and_resumes_from_what_was_sent():
    body = {"prompt": "hi", "max_tokens": 8, "stream": True}
    original = copy.deepcopy(body)
    progress = StreamProgress.for_request("completion", body)
    assert progress.next_body(body) == dict(body, return_token_ids=True)  # nothing sent yet: no resume
    progress.observe(completion_chunk("ab", [1, 2]))
    progress.observe(completion_chunk("c", [3]))
    resume = progress.next_body(body)
    assert resume == dict(body, return_token_ids=True, resume_token_ids=[1, 2, 3], resume_text_chars=3)
    progress.token_ids.append(4)
    assert resume["resume_token_ids"] == [1, 2, 3] and body == original  # copies, not views


def test_sse_framing():
    assert sse("[DONE]") == b"data: [DONE]\n\n"
    assert sse({"text": "é"}) == 'data: {"text": "é"}\n\n'.encode()


def test_a_chat_choices_role_reaches_the_client_once():
    """A retry before the first token starts the chat stream again: its role chunk is dropped,
    and a role that comes with content loses only the role."""
    progress = StreamProgress.for_request("chat", {})
    assert progress.observe(chat_chunk("", [], role="assistant"))["choices"][0]["delta"] == {
        "role": "assistant", "content": ""}
    assert progress.observe(chat_chunk("", [], role="assistant")) is None
    assert progress.observe(chat_chunk("Hi", [7], role="assistant"))["choices"][0]["delta"] == {"content": "Hi"}
    assert progress.token_ids == [7]
