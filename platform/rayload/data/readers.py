"""Parsing of text shards (CSV, JSONL) that never loses a line.

Ray Data's read_csv/read_json stop a whole job on one malformed line, and pyarrow's schema
inference turns one stray "n/a" into a failed cast. Text files are therefore read whole with
`read_binary_files`, declared columns are parsed as strings, and every line that cannot be
split into columns is returned as a quarantine row instead of being dropped.
"""

from __future__ import annotations

import bisect
import csv
import io
import json
import re

import pyarrow as pa
import pyarrow.csv as pacsv

from ..errors import DataError
from .json_values import python_array, read_values


def parse_csv(data: bytes, names: list[str], source: str) -> tuple[pa.Table, list[tuple[str, str]]]:
    """Declared columns as strings; records that cannot be split into them, or are not UTF-8, are
    returned as quarantine rows, each reason naming the record's physical line in the file.

    A quoted value may hold a newline (RFC 4180). pyarrow reads such a file right, but a stray
    quote makes it read on past its line as well: to the end of the file as one bad row, or up to
    the next stray quote as one "good" row holding many lines. So any file in which a record spans
    lines is parsed again record by record (`_read_csv_records`), which tells the two apart. So is
    a file with a bad row or a line that is not UTF-8 (rare): pyarrow's multithreaded reader does
    not know the line number of a bad row, and stops at the first byte that is not UTF-8."""
    data = strip_bom(data)
    if not data.strip():  # an empty shard (a writer's empty part file): no rows, as a header-only one
        return pa.table({n: pa.array([], pa.string()) for n in names}), []
    if b"\n" not in data.rstrip(b"\r"):  # a header alone without its newline: pyarrow called it an empty CSV file
        data = data.rstrip(b"\r") + b"\n"
    first = header_line(data)
    try:
        first.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{source}: the header line is not UTF-8 text: {exc}") from None
    header, _ = _fields(first, strict=False)
    if twice := sorted({n for n in names if header.count(n) > 1}):  # the first was read, the second dropped without a word
        raise DataError(f"{source}: the CSV header names the column(s) {twice} more than once; which one is meant is not clear")
    try:
        table, bad, spanned = _read_csv(data, names, source)
    except _NotUtf8:
        return _read_csv_records(data, names, source)
    # An odd number of quotes in the file: one was never closed (a file cut off inside a quoted
    # value, which pyarrow reads to the end as a good row: no extra line, no bad row to tell)
    if bad or spanned or _spans_lines(data, table.num_rows) or data.count(b'"') % 2:
        return _read_csv_records(data, names, source)
    return table, []


def header_line(data: bytes) -> bytes:
    """The CSV header: the first line that is not blank (the readers skip blank lines before it)."""
    return next((line for line in data.split(b"\n") if line.rstrip(b"\r")), b"")


def strip_bom(data: bytes) -> bytes:
    """A CSV without the UTF-8 byte order mark Excel's "CSV UTF-8" starts with: left on, it is
    part of the first column's name ('\ufeffuser')."""
    return data[3:] if data.startswith(b"\xef\xbb\xbf") else data


def _read_csv(data: bytes, names: list[str], source: str) -> tuple[pa.Table, list[tuple[str, str]], bool]:
    malformed: list[tuple[str, str]] = []
    spanned = []

    def on_invalid(row) -> str:
        text = row.text or ""
        spanned.append("\n" in text)
        malformed.append((text, "malformed CSV row"))  # read again by `_read_csv_records`, which knows its line
        return "skip"

    def read(block_size: int | None) -> pa.Table:
        malformed.clear()  # a retry reads the file again from its start
        spanned.clear()
        return pacsv.read_csv(
            io.BytesIO(data),
            read_options=pacsv.ReadOptions(block_size=block_size) if block_size else None,
            parse_options=pacsv.ParseOptions(invalid_row_handler=on_invalid, newlines_in_values=True),
            convert_options=pacsv.ConvertOptions(
                include_columns=names,
                column_types={n: pa.string() for n in names},
                strings_can_be_null=True,
                null_values=[""],
            ),
        )

    try:
        try:
            table = read(None)
        except pa.ArrowInvalid as exc:
            # A record longer than Arrow's block (1 MB by default, about 2 MB with its slack) stopped
            # the whole file ("straddling object ... increase block size"): the file is in memory,
            # so read it again as one block (single-threaded, only for such files).
            if "straddl" not in str(exc):
                raise
            table = read(min(len(data) + 1, 2**31 - 1))
    except (pa.ArrowInvalid, pa.ArrowKeyError) as exc:
        msg = str(exc)
        if "include_columns" in msg or "No such column" in msg or "does not exist" in msg:
            _missing_columns(data, names, source)
        if "invalid UTF8" in msg:
            raise _NotUtf8() from None
        raise DataError(f"{source}: cannot read as CSV: {msg}") from None
    return table, malformed, any(spanned)


def _spans_lines(data: bytes, records: int) -> bool:
    """Whether some record (a row, good or bad) took more than one physical line: the records
    pyarrow read, the header and the blank lines it skips do not add up to the lines of the file."""
    if not data:
        return False
    lines = data.count(b"\n") + (not data.endswith(b"\n"))
    if records + 1 == lines:
        return False
    blank = len(re.findall(rb"^\r?$", data, re.M)) - data.endswith(b"\n")  # the match after a final newline is no line
    return records + 1 + blank != lines


def _missing_columns(data: bytes, names: list[str], source: str):
    header = header_line(data).decode(errors="replace")
    raise DataError(f"{source}: declared columns {names} are not all in the CSV header: {header!r}") from None


def _read_csv_records(data: bytes, names: list[str], source: str) -> tuple[pa.Table, list[tuple[str, str]]]:
    """Record by record, with Python's csv module. A record is one line, or the lines up to the
    one that closes a quote opened on its first line (a line with an odd number of quotes). Such
    a multi-line record is accepted only when it parses strictly (each closing quote followed by
    a comma or the end) into the header's columns; otherwise its first line holds a stray quote
    and is quarantined alone, and reading resumes at the next line. A fragment of a row is never
    accepted: the line that closes a quoted value has an odd number of quotes, so it cannot be
    read alone as a good row."""
    lines = data.split(b"\n")
    if lines and not lines[-1]:
        lines.pop()
    not_utf8 = _not_utf8(data, lines)
    odd = [i for i, line in enumerate(lines) if line.count(b'"') % 2]
    header = None
    columns: dict[str, list] = {n: [] for n in names}
    malformed: list[tuple[str, str]] = []
    fragments: dict[int, int] = {}  # the line closing a quote whose record failed -> the line that opened it
    i = 0
    while i < len(lines):
        first = i
        if i in fragments:  # the rest of a bad record (NY",3.5,0 after x,"New York): never a row of its own
            malformed.append((lines[i].rstrip(b"\r").decode(errors="replace"),
                              f"malformed CSV line {i + 1}: the end of a quoted value opened on line {fragments[i] + 1}"))
            i += 1
            continue
        if i in not_utf8:
            exc = not_utf8[i]
            if header is None:
                raise DataError(f"{source}: the header line (line {i + 1}) is not UTF-8 text: {exc}")
            malformed.append((lines[i].decode(errors="replace"), f"line {i + 1} is not UTF-8 text ({exc.reason} at byte {exc.start})"))
            i += 1
            continue
        if odd and lines[i].count(b'"') % 2 and _opens_quote(lines[i]):
            k = bisect.bisect_right(odd, i)
            last = odd[k] if k < len(odd) else None
        else:
            last = i
        if last is not None and any(j in not_utf8 for j in range(first + 1, last + 1)):
            last = None  # a "record" through a line that is not text: the quote on the first line is a stray one
        if last is None:  # the quote is never closed: a stray quote
            last, fields, error = i, *_fields(lines[i], strict=False)
            error = error or "an unterminated quote"
        else:
            fields, error = _fields(b"\n".join(lines[first:last + 1]).rstrip(b"\r"), strict=last > first)
        text = b"\n".join(lines[first:last + 1]).rstrip(b"\r").decode(errors="replace")
        i = last + 1
        if not text and not error:  # a blank line (a line holding "" is a record: one empty value)
            continue
        if header is None:
            header = fields
            if any(n not in header for n in names):
                _missing_columns(data, names, source)
            where = [header.index(n) for n in names]
            continue
        if error is None and len(fields) == len(header):
            for n, j in zip(names, where):
                columns[n].append(fields[j] or None)
            continue
        if last > first:  # not a record after all: its first line holds a stray quote
            i = first + 1
            if not _opens_quote(lines[last]):  # it closes the quote; one that opens another is read as its own record
                fragments[last] = first
            text = lines[first].rstrip(b"\r").decode(errors="replace")
            fields, error = _fields(lines[first].rstrip(b"\r"), strict=False)
            error = error or "an unterminated quote"
        got = f"got {len(fields)}" + (f" ({error})" if error else "")
        malformed.append((text, f"malformed CSV line {first + 1}: expected {len(header)} columns, {got}"))
    if header is None:
        raise DataError(f"{source}: the CSV file has no header line")
    return pa.table({n: pa.array(v, pa.string()) for n, v in columns.items()}), malformed


def _not_utf8(data: bytes, lines: list[bytes]) -> dict[int, UnicodeDecodeError]:
    """The index of each line that is not UTF-8, and why."""
    try:
        data.decode("utf-8")
        return {}
    except UnicodeDecodeError:
        pass
    out = {}
    for i, line in enumerate(lines):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as exc:
            out[i] = exc
    return out


def _opens_quote(line: bytes) -> bool:
    """Whether `line` ends inside a quoted value: a quote opens one only at the start of a field
    (RFC 4180, and pyarrow). A quote inside an unquoted value (5" screen) is a character of it:
    counted as an opening quote, its line was quarantined as "an unterminated quote", but only
    in a file that another bad row sent to this reader (pyarrow alone accepted it)."""
    inside, start, j = False, True, 0
    while j < len(line):
        c = line[j:j + 1]
        if inside:
            if c == b'"':
                if line[j + 1:j + 2] == b'"':
                    j += 1  # an escaped quote
                else:
                    inside = False
        elif c == b'"' and start:
            inside = True
        start = not inside and c == b","
        j += 1
    return inside


def _fields(record: bytes, strict: bool) -> tuple[list[str], str | None]:
    """The fields of one record, and why it cannot be read (None when it can)."""
    text = record.rstrip(b"\r").decode("utf-8", errors="replace")
    if b'"' not in record:
        return text.split(","), None
    if len(text) >= csv.field_size_limit():  # the csv module refuses a field past 131,072 characters by default
        csv.field_size_limit(len(text) + 1)  # process-wide, and only ever raised: a longer record is a row like any other
    try:
        return next(csv.reader([text], strict=strict), [""]), None
    except csv.Error as exc:
        return [], str(exc)


class _NotUtf8(Exception):
    pass


def _repeated_keys(line: bytes, names: list[str]) -> list[str]:
    """Declared keys the line's object gives twice. Cheap first: a key given twice has its quoted
    name twice in the line (a value may hold the text too: the line is then read pair by pair)."""
    maybe = [n for n in names if sum(line.count(f) for f in {json.dumps(n).encode(), json.dumps(n, ensure_ascii=False).encode()}) > 1]
    if not maybe:
        return []
    found = []

    def pairs(items):
        keys = [k for k, _ in items]
        found.extend(k for k in maybe if keys.count(k) > 1 and k not in found)
        return dict(items)

    json.loads(line, object_pairs_hook=pairs)
    return found


def jsonl_lines(data: bytes) -> list[bytes]:
    """A JSONL file's lines: they end at \n (a \r before it dropped). splitlines() also broke
    lines at a lone \r, which is whitespace inside JSON, and at form feeds and the like (one
    line read as two bad ones). A final newline ends the last line; it starts no empty one."""
    lines = [line.removesuffix(b"\r") for line in data.split(b"\n")]
    return lines[:-1] if lines and lines[-1] == b"" else lines


def parse_jsonl(data: bytes, names: list[str], source: str, bags: dict[str, str] | None = None) -> tuple[pa.Table, list[tuple[str, str]]]:
    """`bags`: multi_categorical column -> separator. Values are read as serving reads a
    request's (validate.read_values): a bag's JSON array as its joined text; a line with a list
    or an object where the column takes one value is quarantined, naming its line and column."""
    columns: dict[str, list] = {n: [] for n in names}
    malformed: list[tuple[str, str]] = []
    lines: list[tuple[int, bytes]] = []  # each row's line, for the rows refused below
    for number, line in enumerate(jsonl_lines(data), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except UnicodeDecodeError as exc:
            malformed.append((line.decode(errors="replace"), f"line {number} is not UTF-8 text ({exc.reason} at byte {exc.start})"))
            continue
        except ValueError as exc:
            malformed.append((line.decode(errors="replace"), f"invalid JSON on line {number}: {getattr(exc, 'msg', exc)}"))
            continue
        except RecursionError:  # nested ~1,000 deep: it stopped the whole job
            malformed.append((line.decode(errors="replace"), f"invalid JSON on line {number}: nested too deeply"))
            continue
        if not isinstance(obj, dict):
            malformed.append((line.decode(errors="replace"), f"line {number} is not a JSON object"))
            continue
        if twice := _repeated_keys(line, names):  # json.loads keeps the last silently; the CSV reader refuses the same
            malformed.append((line.decode(errors="replace"), f"line {number} gives the key(s) {twice} more than once; "
                              "which value is meant is not clear"))
            continue
        for n in names:
            columns[n].append(obj.get(n))
        lines.append((number, line))
    bags = bags or {}
    read, bad = {}, {}
    for n, values in columns.items():  # as serving reads a request's values (validate.read_values)
        read[n], why = read_values(values, {"role": "multi_categorical" if n in bags else "categorical", "separator": bags.get(n)})
        for i, reason in enumerate(why):
            if reason and i not in bad:
                bad[i] = f"{n}: {reason}"
    if bad:
        keep = [i for i in range(len(lines)) if i not in bad]
        malformed += [(lines[i][1].decode(errors="replace"), f"line {lines[i][0]}: {reason}") for i, reason in sorted(bad.items())]
        read = {n: [v[i] for i in keep] for n, v in read.items()}
    # typed when the JSON values agree, text otherwise, as serving reads a request's (validate.python_array)
    return pa.table({n: python_array(v) for n, v in read.items()}), malformed
