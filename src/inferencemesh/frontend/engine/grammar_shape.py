"""The shape limits of a constraint's text, checked before anything compiles it.

llguidance's compiler recurses on a grammar's structure and its lexer expands counted
repetition, so shape, not size, is what a crafted constraint attacks: nesting, the number of
rules, the chain of rule references, counted repetition. Every check here iterates (never
recurses) and raises ConstraintError naming the request parameter at fault. Real constraints
stay far below these limits.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from inferencemesh.frontend.engine.errors import ConstraintError

MAX_NESTING = 64  # brackets in a regex or grammar; JSON arrays and objects in a schema
MAX_GRAMMAR_RULES = 1_000  # rules and terminals of a Lark or GBNF grammar
MAX_RULE_DEPTH = 200  # the longest chain of rule references (r0 -> r1 -> r2 ...), cycles cut
MAX_REPEAT_EXPANSION = 4_096  # a regex's atoms with counted repetitions written out: (a{1000}){1000} is 10^6


def check_schema_shape(schema: Any, param: str) -> None:
    """Refuse a schema nested deeper than MAX_NESTING (walked with a stack: a deep one is what
    makes the recursive checks after this one fail) or with a pattern past the regex limits."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_NESTING:
            raise ConstraintError(param, f"the JSON schema is nested more than {MAX_NESTING} levels deep")
        if isinstance(node, Mapping):
            for key, value in node.items():
                if key == "pattern" and isinstance(value, str):
                    check_regex(value, param)
                if key == "patternProperties" and isinstance(value, Mapping):
                    for pattern in value:
                        check_regex(str(pattern), param)
                stack.append((value, depth + 1))
        elif isinstance(node, list | tuple):
            stack.extend((item, depth + 1) for item in node)


_COUNTED = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def regex_shape(regex: str) -> tuple[int, int]:
    """(expansion, nesting) of a regular expression: how many atoms it stands for with every
    counted repetition written out (of alternatives, the largest; capped just past
    MAX_REPEAT_EXPANSION), and its deepest group nesting. A scan, not a parser: it errs towards
    larger numbers on syntax it does not know."""
    cap = MAX_REPEAT_EXPANSION + 1
    groups: list[tuple[int, int]] = []  # per open group: (its enclosing best alternative, total so far)
    best = total = last = deepest = 0
    i = 0
    while i < len(regex):
        char = regex[i]
        counted = _COUNTED.match(regex, i) if char == "{" else None
        if char == "\\":
            i += 2
            if regex[i - 1 : i] in ("p", "P", "x", "u", "N") and regex[i : i + 1] == "{":  # \p{Greek}, \x{1F600}
                i = regex.find("}", i) + 1 or len(regex)
            total, last = min(total + 1, cap), 1
            continue
        if char == "[":
            i = _class_end(regex, i)
            total, last = min(total + 1, cap), 1
            continue
        if counted:
            times = int(counted.group(2) or counted.group(1))  # {m}, {m,}: m; {m,n}: n
            total = min(total + last * max(times - 1, 0), cap)
            last = min(last * times, cap)
            i = counted.end()
            continue
        if char == "(":
            groups.append((best, total))
            best = total = 0
            deepest = max(deepest, len(groups))
        elif char == ")" and groups:
            size = max(best, total)
            best, total = groups.pop()
            total, last = min(total + size, cap), size
        elif char == "|":
            best, total, last = max(best, total), 0, 0
        elif char not in "*+?":
            total, last = min(total + 1, cap), 1
        i += 1
    return max(best, total, *(outer for _, outer in groups)), deepest


def _class_end(regex: str, start: int) -> int:
    """The index past a character class [...] starting at start (nested classes included)."""
    depth, i = 0, start
    while i < len(regex):
        char = regex[i]
        if char == "\\":
            i += 2
            continue
        if char == "[":
            depth += 1
            if regex.startswith("[^]", i) or regex.startswith("[]", i):
                i += 2 if regex[i + 1] == "]" else 3
                continue
        elif char == "]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return i


def check_regex(regex: str, param: str) -> None:
    expansion, nesting = regex_shape(regex)
    if nesting > MAX_NESTING:
        raise ConstraintError(param, f"the regular expression nests groups more than {MAX_NESTING} deep")
    if expansion > MAX_REPEAT_EXPANSION:
        raise ConstraintError(param, "the regular expression's counted repetitions expand past "
                                     f"{MAX_REPEAT_EXPANSION} elements (nested or chained {{n}} bounds)")


# Lark: "name:" or "?name.2:" at a line's start; GBNF: "name ::=".
_DEFINITION = re.compile(r"^[ \t]*[?!]?([A-Za-z_][\w-]*)(?:\.-?\d+)?[ \t]*(?:::=|:)", re.M)
_NAME = re.compile(r"[A-Za-z_][\w-]*")
_LARK_RANGE = re.compile(r"~\s*(\d+)(?:\s*\.\.\s*(\d+))?")


def check_grammar_shape(grammar: str, param: str) -> None:
    """Refuse a Lark or GBNF grammar past the limits on rules and terminals, on the chain of
    rule references, on bracket nesting and on counted repetition (its regexes' and its own)."""
    gbnf = "::=" in grammar
    text = _grammar_skeleton(grammar, gbnf, param)
    bodies: dict[str, list[str]] = {}
    definitions = list(_DEFINITION.finditer(text))
    if len(definitions) > MAX_GRAMMAR_RULES:
        raise ConstraintError(param, f"the grammar defines {len(definitions)} rules and terminals; "
                                     f"the limit is {MAX_GRAMMAR_RULES}")
    for this, after in zip(definitions, [*definitions[1:], None], strict=True):
        body = text[this.end() : after.start() if after is not None else len(text)]
        bodies.setdefault(this.group(1), []).extend(_NAME.findall(body))
    depth = _reference_depth(bodies)
    if depth > MAX_RULE_DEPTH:
        raise ConstraintError(param, f"the grammar's rules reference one another {depth} deep; "
                                     f"the limit is {MAX_RULE_DEPTH}")
    nesting = level = 0
    for char in text:
        level += (char in "([{") - (char in ")]}")
        nesting = max(nesting, level)
    if nesting > MAX_NESTING:
        raise ConstraintError(param, f"the grammar nests brackets more than {MAX_NESTING} deep")
    counts = [int(b or a) for a, b in _COUNTED.findall(text)] + \
             [int(b or a) for a, b in _LARK_RANGE.findall(text)]
    if any(count > MAX_REPEAT_EXPANSION for count in counts):
        raise ConstraintError(param, f"the grammar repeats an element more than {MAX_REPEAT_EXPANSION} times")


def _grammar_skeleton(grammar: str, gbnf: bool, param: str) -> str:
    """The grammar with comments dropped and every literal (strings, regexes, GBNF character
    classes) replaced by "": what is left is names, operators and brackets. Each regex is checked
    on the way."""
    out: list[str] = []
    i = 0
    while i < len(grammar):
        char = grammar[i]
        if (gbnf and char == "#") or (not gbnf and grammar.startswith("//", i)):
            i = grammar.find("\n", i)
            if i < 0:
                break
            continue
        if char == '"':
            end = i + 1
            while end < len(grammar) and grammar[end] not in '"\n':
                end += 2 if grammar[end] == "\\" else 1
            out.append('""')
            i = end + 1
            continue
        if not gbnf and char == "/":
            end = i + 1
            while end < len(grammar) and grammar[end] not in "/\n":
                end += 2 if grammar[end] == "\\" else 1
            check_regex(grammar[i + 1 : end], param)
            out.append('""')
            i = end + 1
            continue
        if gbnf and char == "[":
            end = _class_end(grammar, i)
            out.append('""')
            i = end
            continue
        out.append(char)
        i += 1
    return "".join(out)


def _reference_depth(bodies: dict[str, list[str]]) -> int:
    """The longest chain of references between defined rules (a reference back into the chain
    ends it), found without recursion."""
    depth: dict[str, int] = {}
    for root in bodies:
        if root in depth:
            continue
        on_path = {root}
        stack: list[tuple[str, Iterator[str]]] = [(root, iter(bodies[root]))]
        while stack:
            name, refs = stack[-1]
            ref = next((r for r in refs if r in bodies and r not in on_path and r not in depth), None)
            if ref is not None:
                on_path.add(ref)
                stack.append((ref, iter(bodies[ref])))
                continue
            stack.pop()
            on_path.discard(name)
            depth[name] = 1 + max((depth[r] for r in bodies[name] if r in depth), default=0)
    return max(depth.values(), default=0)
