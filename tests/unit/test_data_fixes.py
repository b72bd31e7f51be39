"""Data-plane defects: each test failed on the code before its fix."""

import pytest

from rayload.data.readers import parse_csv
from rayload.errors import DataError

NAMES = ["user", "price", "y"]


def test_a_quoted_newline_is_part_of_its_value_and_never_splits_a_row():
    data = b'user,price,y\nu1,1.5,1\n"New York\nNY",3.5,0\nu2,2.5,1\n'
    table, bad = parse_csv(data, NAMES, "f.csv")
    assert table.column("user").to_pylist() == ["u1", "New York\nNY", "u2"] and not bad
    # a row with a quoted newline and one column too many: quarantined, no half of it accepted
    data = b'user,price,y\nu1,1.5,1\nx,"New York\nNY",3.5,0\nu2,2.5,1\n'
    table, bad = parse_csv(data, NAMES, "f.csv")
    assert table.column("user").to_pylist() == ["u1", "u2"]
    assert all("NY" not in str(v) for v in table.column("price").to_pylist()) and len(bad) == 2
    # a stray quote in a column that is not declared still quarantines only its own line
    data = b"user,note,price,y\n" + b"".join(b"u%d,n,%d,1\n" % (i, i) for i in range(20))
    data = data.replace(b"u5,n,", b'u5,"n,')
    table, bad = parse_csv(data, NAMES, "f.csv")
    assert table.num_rows == 19 and len(bad) == 1 and bad[0][0] == 'u5,"n,5,1' and "line 7" in bad[0][1]


def test_every_csv_reason_names_the_physical_line_and_the_header_error_names_the_file():
    lines = [b"user,price,y"] + [b"user-number-%08d,%d.5,%d" % (i, i, i % 2) for i in range(200_000)]
    lines[150_001] = b"broken,row"  # line 150002, far past pyarrow's first block
    table, bad = parse_csv(b"\n".join(lines) + b"\n", NAMES, "big.csv")
    assert table.num_rows == 199_999 and bad == [("broken,row", "malformed CSV line 150002: expected 3 columns, got 2")]
    rows = [b"user,price,y"] + [b"u%d,%d.5,%d" % (i, i, i % 2) for i in range(20)]
    rows[3] = b"u\xff,1.0,1"  # line 4: not UTF-8
    rows[10] = b"short,row"  # line 11: still line 11 after line 4 is set aside
    rows[12] = b'"u9,9.5,1'  # line 13: a stray quote
    table, bad = parse_csv(b"\n".join(rows[:6] + [b"", b""] + rows[6:]) + b"\n", NAMES, "x.csv")  # and two blank lines
    assert [r.split(":")[0] for _, r in bad] == ["line 4 is not UTF-8 text (invalid start byte at byte 1)",
                                                  "malformed CSV line 13", "malformed CSV line 15"]
    assert table.num_rows == 17
    with pytest.raises(DataError, match="h.csv: the header line"):
        parse_csv(b"us\xffer,price,y\nu1,1,1\n", NAMES, "h.csv")
