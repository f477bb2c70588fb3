"""A kernel parameter passed as a struct by value (``signatures``): parsed with its
fields' constness, laid out as C does, checked field by field, and run by the
emulator with its pointers inside the memory checks."""
import numpy as np
import pytest

from dflash_cupy.backends import signatures
from dflash_cupy.backends.base import KernelLaunchError, check_kernel_args

SRC = r"""
struct ScaleParams {
    const float* a;   // read
    float* out;       // written
    int n;
    float s;
    const double* unused;
    unsigned char flag;
};
struct Helper { float v[4]; int f(int x) { return x; } };   // not a kernel parameter: ignored

extern "C" __global__ void scale(const ScaleParams p, int extra) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < p.n) p.out[i] = p.a[i] * p.s + (float)extra + (float)p.flag;
}
"""


def _sig():
    (k,) = signatures.parse_kernels(SRC)
    return k


def test_struct_fields_constness_and_c_layout():
    k = _sig()
    p, extra = k.params
    assert p.is_struct and not extra.is_struct and extra.dtype == "int32"
    assert [f.name for f in p.fields] == ["a", "out", "n", "s", "unused", "flag"]
    assert [f.read_only for f in p.fields] == [True, False, False, False, True, False]
    dt = p.struct_dtype()
    # pointers 8 B, n and s 4 B each, then a pointer, a byte, padded to 8
    assert [dt.fields[n][1] for n in dt.names] == [0, 8, 16, 20, 24, 32] and dt.itemsize == 40


def test_leaves_arg_and_pack():
    k = _sig()
    a, out = np.arange(4, dtype=np.float32), np.zeros(4, np.float32)
    val = dict(a=a, out=out, n=np.int32(4), s=np.float32(2), unused=np.zeros(1), flag=np.uint8(1))
    leaves = list(signatures.leaves(k.params, (val, np.int32(3))))
    assert [p.name for p, _ in leaves] == ["a", "out", "n", "s", "unused", "flag", "extra"]
    assert signatures.arg(k.params, (val, np.int32(3)), "out") is out
    assert signatures.arg(k.params, (val, np.int32(3)), "extra") == 3
    with pytest.raises(KeyError, match="nope"):
        signatures.arg(k.params, (val, np.int32(3)), "nope")
    rec = signatures.pack_struct(k.params[0], val, lambda v: 0x1000 + v.nbytes)
    assert int(rec["a"]) == 0x1010 and int(rec["n"]) == 4 and float(rec["s"]) == 2.0
    assert len(rec.tobytes()) == 40


def test_struct_args_checked_field_by_field():
    k = _sig()
    good = dict(a=np.zeros(4, np.float32), out=np.zeros(4, np.float32), n=np.int32(4), s=np.float32(1),
                unused=np.zeros(1), flag=np.uint8(0))
    check_kernel_args("scale", k.params, (good, np.int32(0)), np.ndarray)
    with pytest.raises(TypeError, match=r"missing fields \['flag'\]"):
        check_kernel_args("scale", k.params, ({kk: v for kk, v in good.items() if kk != "flag"}, np.int32(0)),
                          np.ndarray)
    with pytest.raises(TypeError, match=r"unknown fields \['extra'\]"):
        check_kernel_args("scale", k.params, ({**good, "extra": 1}, np.int32(0)), np.ndarray)
    with pytest.raises(TypeError, match=r"field \(n: int\) needs dtype int32"):
        check_kernel_args("scale", k.params, ({**good, "n": np.int64(4)}, np.int32(0)), np.ndarray)
    with pytest.raises(TypeError, match="must be a mapping"):
        check_kernel_args("scale", k.params, ((1, 2), np.int32(0)), np.ndarray)


def test_emulator_runs_a_struct_kernel_and_checks_its_pointers(emu):
    fn = emu.compile(SRC, filename="scale_struct.cu").get_function("scale")
    a = emu.asarray(np.arange(40, dtype=np.float32))
    out = emu.zeros((40,), np.float32)
    p = dict(a=a, out=out, n=np.int32(40), s=np.float32(0.5), unused=emu.zeros((1,), np.float64),
             flag=np.uint8(1))
    fn((2,), (32,), (p, np.int32(3)))
    np.testing.assert_array_equal(emu.to_numpy(out), np.arange(40, dtype=np.float32) * 0.5 + 4)
    # a struct's pointer is bounds-checked as a plain pointer parameter is (its field named)
    short = emu.zeros((8,), np.float32)
    with pytest.raises(KernelLaunchError, match="out"):
        fn((2,), (32,), ({**p, "out": short}, np.int32(3)))
        emu.synchronize()


def test_recorded_launch_reads_arguments_by_name():
    from profiling.step_trace import RecordingBackend
    rec = RecordingBackend()
    fn = rec.compile(SRC, filename="scale_struct.cu").get_function("scale")
    p = dict(a=rec.zeros((4,), np.float32), out=rec.zeros((4,), np.float32), n=np.int32(4), s=np.float32(1),
             unused=rec.zeros((1,), np.float64), flag=np.uint8(0))
    fn((1,), (32,), (p, np.int32(7)))
    L = rec.eager[-1]
    assert L.arg("n") == 4 and L.arg("extra") == 7 and L.arg("out").nbytes == 16
    assert len(L.leaves()) == 7
    with pytest.raises(KeyError, match="nope"):
        L.arg("nope")


def test_stream_hazards_follow_struct_field_constness(emu):
    """Hazard tracking reads a struct's fields as it reads plain pointer parameters: the
    ``const float* a`` field is a read (two streams may read it at once), ``float* out`` a
    write (another stream's read of it, or a second writer, is a hazard). Misreading the
    constness either way fails here."""
    from dflash_cupy.backends import StreamOrderError
    fn = emu.compile(SRC, filename="scale_struct_hazard.cu").get_function("scale")
    s1, s2 = emu.stream(), emu.stream()

    def arr(name, n=40):
        return emu.label(emu.asarray(np.zeros(n, np.float32)), name)

    a, out1, out2 = arr("a"), arr("out1"), arr("out2")
    unused = emu.asarray(np.zeros(1))

    def p(src, dst):
        return dict(a=src, out=dst, n=np.int32(40), s=np.float32(1), unused=unused, flag=np.uint8(0))

    fn((2,), (32,), (p(a, out1), np.int32(0)), stream=s1)
    fn((2,), (32,), (p(a, out2), np.int32(0)), stream=s2)       # a read by both: no hazard
    with pytest.raises(StreamOrderError, match=r"read-after-write hazard on 'out1'.*kernel scale \(a\)"):
        fn((2,), (32,), (p(out1, out2), np.int32(0)), stream=s2)  # out1 written on s1, read on s2
    with pytest.raises(StreamOrderError, match=r"write-after-read hazard on 'a'.*kernel scale \(out\)"):
        fn((2,), (32,), (p(out2, a), np.int32(0)), stream=s2)     # a read on s1, written on s2
    emu.synchronize()
