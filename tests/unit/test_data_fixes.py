"""Data-plane defects: each test failed on the code before its fix."""

import pyarrow as pa

from rayload.data.readers import parse_csv

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
