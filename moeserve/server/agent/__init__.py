"""The API agents use: tool calls and reasoning in chat replies.

    protocol.py       the chat's messages (tool calls, tool answers, reasoning in the history),
                      tools, tool_choice, and the tool calls of a reply
    choice.py         --tool-call-parser / --reasoning-parser: which formats, and why ("auto"
                      reads the model's chat template)
    tool_formats.py   each family's tool-call text (hermes, glm45/47, deepseek_v3/31/32,
                      kimi_k2, mistral): parsed from replies, written for the default template
    tool_splitter.py  a reply's content -> text and tool calls, incrementally
    reasoning.py      a reply -> reasoning (<think>...</think>) and content, incrementally
    reply.py          the two in a row: what the chat route feeds each choice's text through
"""
