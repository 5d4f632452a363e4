"""What a client has received of a streamed request, so that another replica can take over.

The router asks replicas for each chunk's token ids (`return_token_ids`). If the replica dies or
stalls, the request goes to another replica with `resume_token_ids` (the tokens generated so far)
and `resume_text_chars` (the characters of their text already sent): the new replica recomputes
them like a preempted request and continues. Greedy and seeded requests (the router seeds every
sampled request) produce exactly the tokens the first replica would have, so the client's stream
goes on with no gap, repeat or error. Some streams are not resumed, only retried before their
first byte (`not_resumable`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class StreamProgress:
    kind: str  # "completion" | "chat"
    client_wants_token_ids: bool
    echo_pending: bool  # a completions echo chunk (the prompt, not output) may come first
    token_ids: list[int] = field(default_factory=list)
    num_text_chars: int = 0
    response_id: str | None = None
    created: int | None = None
    finished: bool = False  # a finish_reason was seen
    roles_sent: set[int] = field(default_factory=set)  # chat choices whose role chunk the client has

    @classmethod
    def for_request(cls, kind: str, body: dict) -> "StreamProgress":
        return cls(kind, bool(body.get("return_token_ids")), kind == "completion" and bool(body.get("echo")))

    def observe(self, chunk: dict) -> dict | None:
        """Record one chunk from a replica; return it as the client should see it (the first
        replica's id and timestamp, token ids only if the client asked for them), or None when
        the client has it already (a chat choice's role chunk again, from a retry)."""
        if self.kind == "chat" and chunk.get("choices") and self._repeats_role(chunk):
            return None
        if self.response_id is None:
            self.response_id, self.created = chunk.get("id"), chunk.get("created")
        else:
            chunk["id"], chunk["created"] = self.response_id, self.created
        for choice in chunk.get("choices", []):
            ids = choice.get("token_ids") if self.client_wants_token_ids else choice.pop("token_ids", None)
            text = choice.get("text") if self.kind == "completion" else (choice.get("delta") or {}).get("content")
            if self.echo_pending and not ids:
                self.echo_pending = False
                continue  # the echoed prompt: the client has it, but it is not output text
            self.echo_pending = False
            self.token_ids.extend(ids or [])
            self.num_text_chars += len(text or "")
            if choice.get("finish_reason"):
                self.finished = True
        return chunk

    def _repeats_role(self, chunk: dict) -> bool:
        """Drop the role from choices whose role was sent; True if nothing else is left."""
        empty = True
        for choice in chunk["choices"]:
            delta, index = choice.get("delta") or {}, choice.get("index", 0)
            if "role" in delta:
                if index in self.roles_sent:
                    delta.pop("role")
                self.roles_sent.add(index)
            if any(delta.values()) or choice.get("finish_reason") or choice.get("token_ids") or "role" in delta:
                empty = False
        return empty

    def next_body(self, body: dict) -> dict:
        """The request to send to the next replica: the original, or a resume if tokens came."""
        body = dict(body, return_token_ids=True)
        if self.token_ids:
            body.update(resume_token_ids=list(self.token_ids), resume_text_chars=self.num_text_chars)
        return body


def not_resumable(body: dict) -> str | None:
    """Why a stream of `body` cannot continue on another replica once it has sent tokens (None:
    it can). With n > 1 the choices' progress is not tracked apart; a reply that may call tools
    streams deltas computed from its whole text, of which the router counts only the content."""
    if body.get("n", 1) != 1:
        return "a stream with n > 1 cannot be resumed"
    if body.get("tools") and body.get("tool_choice") != "none":
        return "a stream that may call tools cannot be resumed mid-stream"
    return None


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()
