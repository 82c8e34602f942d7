"""Python's view of the wire and map structs equals what bcc compiled."""
import ctypes

import pytest

from xagg.wire.proto import HDR_DTYPE, VERDICTS, C, constants, struct_dtype


def ctypes_layout(ct):
    return [(name, getattr(ct, name).offset, getattr(ct, name).size) for name, *_ in ct._fields_]


def dtype_layout(dt):
    return [(name, dt.fields[name][1], dt.fields[name][0].itemsize) for name in dt.names]


@pytest.mark.parametrize("struct,table", [("xagg_hdr", b"layout_hdr"), ("xagg_meta", b"layout_meta")])
def test_wire_structs_match_bcc(xdp_program, struct, table):
    leaf = xdp_program.bpf[table].Leaf
    dt = struct_dtype(struct)
    assert dt.itemsize == ctypes.sizeof(leaf)
    assert dtype_layout(dt) == ctypes_layout(leaf)


def test_header_is_40_bytes_and_8_aligned():
    assert HDR_DTYPE.itemsize == 40 and HDR_DTYPE.fields["worker_mask"][1] % 8 == 0


def test_map_structs_match_bcc(xdp_program):
    for struct, table in (("xagg_job", b"jobs"), ("xagg_worker", b"workers"), ("xagg_worker", b"children"),
                          ("xagg_slot", b"slots")):
        leaf = xdp_program.bpf[table].Leaf
        assert dtype_layout(struct_dtype(struct, "xagg_maps.h")) == ctypes_layout(leaf)


def test_constants_and_verdicts_parsed_from_header():
    c = constants()
    assert c.XAGG_MAGIC.to_bytes(4, "little") == b"XAGG"
    assert VERDICTS[c.XAGG_V_BAD_COOKIE] == "bad_cookie" and len(VERDICTS) == C.XAGG_NR_VERDICTS


def test_specialised_sizes_follow_cflags():
    assert struct_dtype("xagg_hdr").itemsize == 40
    assert struct_dtype("xagg_job_stats", "xagg_maps.h").itemsize == 32
