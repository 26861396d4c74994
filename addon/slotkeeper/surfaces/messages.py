"""Anthropic `/v1/messages` served through llama-server's `/v1/chat/completions`, so it can be
pinned (the server's own `/v1/messages` drops `id_slot`). The mitmproxy glue around the pure
translation in `anthropic.py`; listed before SlotKeeper, which routes the rewritten request and
hands the answer back to the translation left in the flow (see translation.py)."""

from __future__ import annotations

import logging

from mitmproxy import ctx, http

from ..wire import bodies, replies
from ..wire.bodies import BodyError, BodyRefused
from ..wire.translation import TRANSLATION_KEY
from . import anthropic
from .anthropic import NotTranslatable
from .anthropic_answers import StreamTranslator, message_from_chat

log = logging.getLogger("slotkeeper.messages")

ORIGINAL_PATH_KEY = "slotkeeper_original_path"  # flow.metadata: the path the client asked for


class MessagesTranslation:
    """One translated flow: llama-server's chat answer back into an Anthropic one."""

    def __init__(self) -> None:
        self.stream = StreamTranslator()

    def response_headers(self, response: http.Response) -> None:
        # The event stream keeps llama-server's text/event-stream; its length changes.
        response.headers.pop("content-length", None)

    def whole(self, response: http.Response) -> None:
        raw = response.content or b""
        if response.status_code != 200:
            answer = anthropic.error_from_chat(response.status_code, raw)
        else:
            try:
                answer = message_from_chat(bodies.parse_json_object(raw))
            except (BodyError, NotTranslatable) as e:
                log.warning("llama-server's chat answer could not be translated: %s", e)
                response.status_code = 502
                answer = anthropic.error_from_chat(
                    502, f"slotkeeper could not read llama-server's answer: {e}".encode())
        response.headers.pop("content-encoding", None)
        response.headers["content-type"] = "application/json"
        response.content = anthropic.encode_json(answer)


class AnthropicMessages:
    """Rewrites POST /v1/messages into POST /v1/chat/completions (see anthropic.py for why and
    how). A body it cannot translate, or cannot read, is answered here with Anthropic's error
    shape (413 over the size limit, 400 otherwise), never in another API's.
    `/v1/messages/count_tokens` is not a completion and passes through."""

    def __init__(self, keeper) -> None:
        self.keeper = keeper  # its max_body_bytes bounds what is read here too
        self.enabled = True

    def load(self, loader) -> None:
        loader.add_option("slotkeeper_translate_messages", bool, True,
                          "Serve Anthropic /v1/messages through llama-server's "
                          "/v1/chat/completions, so it can be pinned to a slot (llama-server "
                          "b11434 ignores id_slot on /v1/messages).")

    def configure(self, updated: set[str]) -> None:
        if "slotkeeper_translate_messages" in updated:
            self.enabled = ctx.options.slotkeeper_translate_messages

    def on_request(self, flow: http.HTTPFlow) -> None:
        req = flow.request
        if (not self.enabled or flow.response is not None or req.method != "POST"
                or not anthropic.is_messages_route(req.path)):
            return
        try:
            body = bodies.parse_json(bodies.read_body(
                req.raw_content, req.headers.get("content-encoding", ""),
                self.keeper.max_body_bytes))
            chat = anthropic.to_chat_request(body)
            if isinstance(body.get("model"), str):
                # A router or llama-swap picks the model's server by it (issue #22); a
                # single llama-server ignores it.
                chat["model"] = body["model"]
            encoded = anthropic.encode_json(chat)
        except (BodyError, NotTranslatable) as e:
            status = e.status if isinstance(e, BodyRefused) else 400
            flow.response = replies.error_reply(status, str(e), replies.ANTHROPIC)
            log.info("%s %s answered %d: %s", req.method, req.path, status, e)
            return
        flow.metadata[ORIGINAL_PATH_KEY] = req.path
        flow.metadata[TRANSLATION_KEY] = MessagesTranslation()
        req.path = anthropic.chat_path(req.path)
        req.headers.pop("content-encoding", None)
        req.headers.pop("transfer-encoding", None)
        # The answer is rewritten chunk by chunk: it must arrive uncompressed.
        req.headers["accept-encoding"] = "identity"
        req.content = encoded
        req.headers["content-length"] = str(len(encoded))
        # SlotKeeper reads this body next: it need not decode and parse it again.
        flow.metadata[bodies.PARSED_KEY] = (encoded, chat)
