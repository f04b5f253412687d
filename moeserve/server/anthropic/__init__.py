"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) over the chat
machinery: protocol.py parses and describes the wire shapes, convert.py turns a request into the
chat request it is (messages, tools, tool_choice, thinking), events.py renders replies as
Anthropic's content blocks and stream events. The route is server/routes/messages.py."""
