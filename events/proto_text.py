"""Which message a Schema Registry message-index path names in a ``.proto`` schema's text.

A registry returns a protobuf schema as the text of its ``.proto`` file; the framing's index path
counts messages in declaration order (``[1, 0]``: the first message nested in the file's second).
Only the declarations are read: comments and string literals are dropped, then ``package``,
``message NAME {`` and the braces of every other block are followed.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass, field
from typing import Final

from google.protobuf import descriptor_pb2
from google.protobuf.message import DecodeError as ProtobufDecodeError

_TOKEN: Final = re.compile(
    r"""//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|[A-Za-z_][\w.]*|[{};]|\S""",
    re.DOTALL,
)


class ProtoTextError(ValueError):
    """The schema text does not declare the message the path names."""


@dataclass
class _Message:
    name: str
    nested: list[_Message] = field(default_factory=list)


@dataclass(frozen=True)
class ProtoFile:
    """A ``.proto`` file's package and its messages' tree, in declaration order."""

    package: str
    messages: tuple[_Message, ...]

    def message_name(self, indexes: tuple[int, ...]) -> str:
        """The full name (``package.Outer.Inner``) at ``indexes``, or :class:`ProtoTextError`."""
        level: list[_Message] | tuple[_Message, ...] = self.messages
        names: list[str] = []
        for depth, index in enumerate(indexes):
            if index >= len(level):
                raise ProtoTextError(
                    f"message index {list(indexes)} is past the schema's {len(level)} message(s)"
                    + (f" nested in {'.'.join(names)}" if depth else "")
                )
            names.append(level[index].name)
            level = level[index].nested
        return ".".join([self.package, *names] if self.package else names)


def parse(text: str) -> ProtoFile:
    """The package and message tree of a ``.proto`` file's text."""
    tokens = [t for t in _TOKEN.findall(text) if not t.startswith(("//", "/*", '"', "'"))]
    package = ""
    root: list[_Message] = []
    # The open blocks: a message's nested list, or None for any other block (enum, oneof, service…).
    stack: list[list[_Message] | None] = [root]
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "package" and len(stack) == 1 and i + 1 < len(tokens):
            package = tokens[i + 1]
            i += 2
            continue
        if token == "message" and i + 2 < len(tokens) and tokens[i + 2] == "{":
            message = _Message(tokens[i + 1])
            current = stack[-1]
            if current is not None:
                current.append(message)
            stack.append(message.nested)
            i += 3
            continue
        if token == "{":
            stack.append(None)
        elif token == "}" and len(stack) > 1:
            stack.pop()
        i += 1
    return ProtoFile(package, tuple(root))


def _tree(messages: list[descriptor_pb2.DescriptorProto]) -> list[_Message]:
    return [_Message(m.name, _tree(list(m.nested_type))) for m in messages]


def parse_schema(schema: str) -> ProtoFile:
    """A registry's schema string: ``.proto`` text, or (as confluent-kafka's clients register it and
    some registries return it) a base64 ``FileDescriptorProto``."""
    parsed = parse(schema)
    if parsed.messages or parsed.package:
        return parsed
    try:
        descriptor = descriptor_pb2.FileDescriptorProto.FromString(base64.b64decode(schema, validate=True))
    except (binascii.Error, ValueError, ProtobufDecodeError):
        return parsed
    return ProtoFile(descriptor.package, tuple(_tree(list(descriptor.message_type))))
