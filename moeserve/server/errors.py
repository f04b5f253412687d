"""OpenAI-style errors: one exception type for the routes, and its JSON.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": 400}}

The Messages API's routes answer the same errors in Anthropic's shape (`to_anthropic_dict`):

    {"type": "error", "error": {"type": "invalid_request_error", "message": "..."},
     "request_id": "msg-..."}

Routes raise `APIError`; the app turns it into that JSON (with Retry-After on 429). pydantic's
validation errors become one APIError naming the first bad field: "unsupported field 'x'" for a
field we do not have, "<field>: <what is wrong>" otherwise.
"""

from __future__ import annotations

import msgspec
from pydantic import ValidationError
from starlette.responses import Response

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error",
          500: "internal_error", 503: "service_unavailable"}

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    404: "not_found_error", 405: "invalid_request_error",
                    408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                    500: "api_error", 503: "overloaded_error"}

# Segments pydantic adds to a location for the members of a union type: not field names.
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class APIError(Exception):
    """An error answered to the client as OpenAI-style JSON with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.status}}

    def to_anthropic_dict(self, request_id: str | None = None) -> dict:
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(self.status, "api_error"),
                                           "message": self.message},
                "request_id": request_id or None}

    def to_response(self, request_id: str | None = None, anthropic: bool = False) -> Response:
        """The JSON response; `anthropic`: in the Messages API's shape."""
        headers = dict(self.headers)
        if request_id:
            headers["X-Request-Id"] = request_id
        body = self.to_anthropic_dict(request_id) if anthropic else self.to_dict()
        return Response(msgspec.json.encode(body), status_code=self.status,
                        headers=headers, media_type="application/json")


def _location(loc: tuple[int | str, ...]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content', without union-member tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part not in _UNION_TAGS:
            out += f".{part}" if out else part
    return out


def from_validation_error(err: ValidationError) -> APIError:
    """The first error of a pydantic ValidationError as a 400 naming its field."""
    first = err.errors(include_url=False)[0]
    param = _location(first["loc"])
    if first["type"] == "extra_forbidden":
        return APIError(400, f"unsupported field '{param}'", param)
    if first["type"] == "value_error":
        text = str(first["ctx"]["error"])
        if not param:  # a model validator: its message starts with the field's name
            param = text.split(" ", 1)[0]
            return APIError(400, text, param)
        return APIError(400, f"{param} {text}", param)
    if first["type"] == "missing":
        return APIError(400, f"{param} is required", param)
    if first["type"] == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first['msg']}", None)
    if not param:
        return APIError(400, f"the body must be a JSON object: {first['msg']}", None)
    return APIError(400, f"{param}: {first['msg']}", param)
