"""The session's events to its client: an id on each, GA or beta names, items in the client's
generation's shape.

One `ServerEvents` per session (`Session.events`); its response runs write through the same
one, so every event of a session, whoever sends it, is named and shaped alike.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from omni_server.serve.realtime.conversation import Item
from omni_server.serve.realtime.protocol import BETA_NAMES, BETA_PARTS, Ids


class ServerEvents:
    def __init__(self, ws: web.WebSocketResponse, *, beta: bool) -> None:
        self.ws, self.beta = ws, beta
        self.ids = Ids()  # every id of the session (events, items, responses) comes from here

    async def send(self, event: dict[str, Any]) -> None:
        """Write one server event; nothing once the socket is closed (the session is ending)."""
        if self.ws.closed:
            return
        event = {"event_id": self.ids.new("event"), **event}
        if self.beta:
            event["type"] = BETA_NAMES.get(event["type"], event["type"])
        _part_types(event)
        await self.ws.send_str(json.dumps(event))

    def item_view(self, item: Item) -> dict[str, Any]:
        return item.beta() if self.beta else item.ga()

    async def item_added(self, item: Item, previous: str | None) -> None:
        """`conversation.item.added` (beta: `.created`), and GA's `.done` for a finished item."""
        view = self.item_view(item)
        await self.send(
            {"type": "conversation.item.added", "item": view, "previous_item_id": previous}
        )
        if not self.beta and item.status == "completed":
            await self.send(
                {"type": "conversation.item.done", "item": view, "previous_item_id": previous}
            )


def _part_types(event: dict[str, Any]) -> None:
    """A content part event's `part` typed "audio" / "text", in GA as in beta (`BETA_PARTS`)."""
    part = event.get("part")
    if isinstance(part, dict) and part.get("type") in BETA_PARTS:
        event["part"] = {**part, "type": BETA_PARTS[part["type"]]}
