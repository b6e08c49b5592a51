// attn_lt._fastpath: the cached fused call of attn_lt.attention() in C++ (a CPython extension over PyTorch's C++
// tensors, built against the installed torch by native/build.py, which `pip install .` and `make native` run;
// attn_lt/fastpath.py loads it).
//
// A decode loop calls attention() with tensors of one family (shapes, strides, dtypes, device, alignment: all but
// the key length and the K/V strides) and the same options. The fused kernels take the key length and the K/V
// strides as data (the launchers cut the planned key split to the keys, native/common.cuh's dense_parts), so one
// fused plan runs every call of its family whose key length the selector sends to it. This file is the only place
// of that rule: attn_lt/api.py keys its plans by the exact call, and remembers a fused plan here after running it
// (`remember`: the tensors of that call, the options, the key range the selector's route gives, launch arguments,
// stream and scratch addresses). `call` runs a later call whose family, options, settings, stream and device are
// those of a remembered plan, in a few hundred nanoseconds where Python's plan lookup takes ~80 k instructions, and
// returns None for anything else, which then takes the Python path (which also words every error: nothing is
// raised here). K/V strides are the launcher's to accept (it refuses those its kernel cannot read, and the call then
// takes the Python path). AttentionPlan.run does the same through a handle of its own (`bind`, `run`: exactly the
// plan's tensors' family, key length and K/V strides).
#include <Python.h>

#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "attn_lt.h"

namespace {

using Launch = int (*)(const attn_lt_flash_args*, void*);

constexpr size_t kEntries = 8;       // families remembered (most recent first)
constexpr Py_ssize_t kOptions = 10;  // causal, scale, backend, workspace_bytes, threshold, algo_policy,
                                     // key_mass_window, out_layout, window, softcap (attention()'s arguments a
                                     // plan depends on)

// The call's tensors as the family sees them (what api.call_signature's family holds, with no mask and out=None).
struct Family {
    std::array<int64_t, 4> q_sizes{}, q_strides{};
    std::array<int64_t, 3> k_sizes{}, v_sizes{};  // batch, heads, head dim (not the key length)
    c10::ScalarType q_dtype{}, k_dtype{}, v_dtype{};
    int device = -1, k_device = -1, v_device = -1;  // -1: CPU
    int64_t align = 256;  // the lowest set bit of q | k | v's addresses, at most 256
    bool v_in_k = false;  // v starts at k's address (an MLA latent cache)

    bool operator==(const Family& o) const {
        return q_sizes == o.q_sizes && q_strides == o.q_strides && k_sizes == o.k_sizes && v_sizes == o.v_sizes &&
               q_dtype == o.q_dtype && k_dtype == o.k_dtype && v_dtype == o.v_dtype && device == o.device &&
               k_device == o.k_device && v_device == o.v_device && align == o.align && v_in_k == o.v_in_k;
    }
};

Family family_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    Family f;
    for (int i = 0; i < 4; ++i) {
        f.q_sizes[i] = q.size(i);
        f.q_strides[i] = q.stride(i);
    }
    const int other[3] = {0, 1, 3};
    for (int i = 0; i < 3; ++i) {
        f.k_sizes[i] = k.size(other[i]);
        f.v_sizes[i] = v.size(other[i]);
    }
    f.q_dtype = q.scalar_type();
    f.k_dtype = k.scalar_type();
    f.v_dtype = v.scalar_type();
    f.device = q.get_device();
    f.k_device = k.get_device();
    f.v_device = v.get_device();
    const auto kp = reinterpret_cast<uintptr_t>(k.data_ptr()), vp = reinterpret_cast<uintptr_t>(v.data_ptr());
    const uintptr_t bits = reinterpret_cast<uintptr_t>(q.data_ptr()) | kp | vp;
    f.align = bits ? std::min<int64_t>(256, int64_t(bits & (~bits + 1))) : 256;
    f.v_in_k = kp == vp;
    return f;
}

// What a launch needs beyond the call's tensors: the output's shape, the argument struct (its addresses, key length
// and K/V strides set by each call), the launcher, the stream and the scratch that serve it.
struct LaunchSpec {
    std::array<int64_t, 4> out_sizes{};
    attn_lt_flash_args args{};
    Launch launch = nullptr;
    int64_t lse_part_offset = 0;
    long long stream = 0;
    uintptr_t workspace = 0, lse = 0;
};

// attention()'s calls of one family and options (the family's last fused plan, over its key range).
struct Entry {
    Family family;
    PyObject* options = nullptr;  // a tuple of kOptions objects (owned)
    PyObject* settings = nullptr; // the settings it was remembered under, a tuple (owned)
    int64_t sk_lo = 1, sk_hi = 0;
    bool sinks = false;  // the calls pass attention sinks (FP32 (Hq,) on q's device, read per call)
    LaunchSpec spec;
};

// One AttentionPlan's run(): its own tensors' family, key length and K/V strides exactly.
struct Bound {
    Family family;
    int64_t Sk = 0;
    std::array<int64_t, 4> k_strides{}, v_strides{};
    LaunchSpec spec;
    uint64_t generation = 0;  // valid while it is the module's (clear() moves on)
};

std::vector<Entry> entries;  // most recent first; guarded by the GIL (nothing here releases it)
uint64_t generation = 1;     // of the scratch the launches write: clear() starts a new one
PyObject* current_device = nullptr;  // () -> int: the current CUDA device
PyObject* raw_stream = nullptr;      // (device) -> int: its current stream
PyObject* capturing = nullptr;       // () -> bool: whether that stream captures a CUDA graph
PyObject* settings_src = nullptr;    // where the settings in force are: a dict (attn_lt.config)
PyObject* settings_keys = nullptr;   // its keys that plans depend on (a tuple)
long long hits = 0;
constexpr const char* kBound = "attn_lt._fastpath.Bound";

void drop(Entry& e) {
    Py_CLEAR(e.options);
    Py_CLEAR(e.settings);
}

// Take entry i out of `entries`, its references released after the vector is consistent again.
void erase_entry(size_t i) {
    Entry gone = entries[i];
    entries.erase(entries.begin() + i);
    drop(gone);
}

void clear_entries() {
    ++generation;
    std::vector<Entry> old;
    old.swap(entries);  // the references go after the module's state is consistent (a __del__ may call back)
    for (auto& e : old) drop(e);
}

// An object the fast path compares: None, or exactly bool, int, float, str or bytes, or a tuple of those (a
// window) (the options attention()'s plans are keyed on). Their == runs no Python code (and never releases the
// GIL); anything else (a list, an array, a tensor, a subclass) is left to the Python path, which keys plans by
// hash and ==.
bool simple(PyObject* o) {
    if (PyTuple_CheckExact(o)) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(o); ++i) {
            PyObject* x = PyTuple_GET_ITEM(o, i);
            if (PyTuple_Check(x) || !simple(x)) return false;
        }
        return true;
    }
    return o == Py_None || PyBool_Check(o) || PyLong_CheckExact(o) || PyFloat_CheckExact(o) ||
           PyUnicode_CheckExact(o) || PyBytes_CheckExact(o);
}

// Equal as dict keys are: the same object (the usual case: interned strings, None, a layer's scaling) or two
// simple objects that compare equal.
bool same(PyObject* a, PyObject* b) {
    if (a == b) return true;
    if (!simple(a) || !simple(b)) return false;
    const int r = PyObject_RichCompareBool(a, b, Py_EQ);  // (tuples of simple objects: element by element)
    if (r < 0) PyErr_Clear();
    return r == 1;
}

// Two tuples of simple objects, element by element.
bool same_items(PyObject* a, PyObject* b) {
    if (a == b) return true;
    if (!PyTuple_Check(a) || !PyTuple_Check(b) || PyTuple_GET_SIZE(a) != PyTuple_GET_SIZE(b)) return false;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(a); ++i)
        if (!same(PyTuple_GET_ITEM(a, i), PyTuple_GET_ITEM(b, i))) return false;
    return true;
}

// Whether the settings in force are still those of the entry.
bool settings_hold(PyObject* snapshot) {
    const Py_ssize_t n = PyTuple_GET_SIZE(settings_keys);
    if (PyTuple_GET_SIZE(snapshot) != n) return false;
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* now = PyDict_GetItemWithError(settings_src, PyTuple_GET_ITEM(settings_keys, i));  // borrowed
        if (now == nullptr && PyErr_Occurred()) {
            PyErr_Clear();
            return false;
        }
        PyObject* then = PyTuple_GET_ITEM(snapshot, i);
        if (!same(now == nullptr ? Py_None : now, then)) return false;
    }
    return true;
}

bool tensor_arg(PyObject* o) { return THPVariable_CheckExact(o); }

long long call_long(PyObject* fn, PyObject* arg) {
    PyObject* r = arg == nullptr ? PyObject_CallNoArgs(fn) : PyObject_CallOneArg(fn, arg);
    if (r == nullptr) {
        PyErr_Clear();
        return -1;
    }
    const long long v = PyLong_AsLongLong(r);  // True/False are ints
    Py_DECREF(r);
    if (v == -1 && PyErr_Occurred()) PyErr_Clear();
    return v;
}

// The LaunchSpec of arguments (out_sizes, args, launch, lse_part_offset, stream, workspace, lse); false with a
// TypeError set when they are not that.
bool parse_spec(PyObject* const* a, LaunchSpec& s) {
    if (!PyTuple_Check(a[0]) || PyTuple_GET_SIZE(a[0]) != 4 || !PyBytes_Check(a[1]) ||
        PyBytes_GET_SIZE(a[1]) != Py_ssize_t(sizeof(attn_lt_flash_args))) {
        PyErr_Format(PyExc_TypeError, "a launch is (out_sizes: 4-tuple, args: bytes of %zu, launch, lse_part_offset, "
                     "stream, workspace, lse)", sizeof(attn_lt_flash_args));
        return false;
    }
    for (int i = 0; i < 4; ++i) s.out_sizes[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(a[0], i));
    std::memcpy(&s.args, PyBytes_AS_STRING(a[1]), sizeof(attn_lt_flash_args));
    s.launch = reinterpret_cast<Launch>(PyLong_AsVoidPtr(a[2]));
    s.lse_part_offset = PyLong_AsLongLong(a[3]);
    s.stream = PyLong_AsLongLong(a[4]);
    s.workspace = reinterpret_cast<uintptr_t>(PyLong_AsVoidPtr(a[5]));
    s.lse = reinterpret_cast<uintptr_t>(PyLong_AsVoidPtr(a[6]));
    if (PyErr_Occurred()) return false;
    if (s.launch == nullptr) {
        PyErr_SetString(PyExc_TypeError, "launch is a null address");
        return false;
    }
    return true;
}

// q, k, v of a call, or false: three exact torch.Tensor objects (subclasses keep their Python semantics on the
// Python path), dense, 4-D, with storage (not a sparse, nested, meta or functorch-wrapped tensor), on one kind of
// device. Nothing here throws.
bool unpack(PyObject* const* a, const at::Tensor** t) {
    for (int i = 0; i < 3; ++i) {
        if (!tensor_arg(a[i])) return false;
        const at::Tensor& x = THPVariable_Unpack(a[i]);
        if (!x.defined() || x.layout() != at::kStrided || x.is_nested() || !x.has_storage() || x.is_meta() ||
            x.dim() != 4 || (x.device().type() != at::kCUDA && x.device().type() != at::kCPU))
            return false;
        t[i] = &x;
    }
    return true;
}

enum class Outcome { kDone, kDeclined, kFailed };

// Launch `s` for q, k, v (whose family the caller matched): the new output in *out, or kDeclined (grad; another
// device or stream; a graph capture; the allocation failed) or kFailed (the launcher refused).
Outcome launch(const LaunchSpec& s, uint64_t gen, int device, const at::Tensor& q, const at::Tensor& k,
               const at::Tensor& v, const float* sinks, PyObject** out) {
    if (c10::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad()))
        return Outcome::kDeclined;  // the Python path raises NotImplementedError
    if (device >= 0) {
        if (call_long(current_device, nullptr) != device || call_long(capturing, nullptr) != 0)
            return Outcome::kDeclined;
        PyObject* dev = PyLong_FromLong(device);
        const long long stream = dev == nullptr ? -1 : call_long(raw_stream, dev);
        Py_XDECREF(dev);
        if (stream != s.stream || gen != generation) return Outcome::kDeclined;  // the scratch moved meanwhile
    }
    at::Tensor o;
    try {
        o = at::empty(s.out_sizes, q.options());
    } catch (const std::exception&) {
        return Outcome::kDeclined;  // the Python path allocates again and reports
    }
    attn_lt_flash_args args = s.args;
    args.q = q.data_ptr();
    args.k = k.data_ptr();
    args.v = v.data_ptr();
    args.o = o.data_ptr();
    args.lse = reinterpret_cast<float*>(s.lse);
    args.mask = nullptr;
    args.sinks = sinks;
    args.o_part = reinterpret_cast<float*>(s.workspace);
    args.lse_part = reinterpret_cast<float*>(s.workspace + s.lse_part_offset);
    args.Sk = k.size(2);
    args.k_sb = k.stride(0), args.k_sh = k.stride(1), args.k_ss = k.stride(2);
    args.v_sb = v.stride(0), args.v_sh = v.stride(1), args.v_ss = v.stride(2);
    if (s.launch(&args, reinterpret_cast<void*>(s.stream)) != 0) return Outcome::kFailed;
    ++hits;
    *out = THPVariable_Wrap(std::move(o));
    return Outcome::kDone;
}

// configure(current_device, raw_stream, capturing, settings_src, settings_keys): where the stream, the device and
// the settings come from (PyTorch's calls, attn_lt.config's dict); clears the entries.
PyObject* configure(PyObject*, PyObject* const* args, Py_ssize_t n) {
    if (n != 5 || !PyDict_Check(args[3]) || !PyTuple_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError,
                        "configure(current_device, raw_stream, capturing, settings_src: dict, settings_keys: tuple)");
        return nullptr;
    }
    clear_entries();
    PyObject** slots[5] = {&current_device, &raw_stream, &capturing, &settings_src, &settings_keys};
    for (int i = 0; i < 5; ++i) {
        Py_INCREF(args[i]);
        Py_XSETREF(*slots[i], args[i]);
    }
    Py_RETURN_NONE;
}

// generation() -> int: the scratch's generation now; remember and bind take the one read before the scratch
// addresses, and take nothing if a clear() came in between.
PyObject* current_generation(PyObject*, PyObject*) { return PyLong_FromUnsignedLongLong(generation); }

// The sinks of a call (None, or FP32 (Hq,) contiguous on q's device, as api.check_sinks takes them): their address
// in *out (null for None); false for anything else.
bool sinks_of(PyObject* o, const at::Tensor& q, const float** out) {
    *out = nullptr;
    if (o == Py_None) return true;
    if (!tensor_arg(o)) return false;
    const at::Tensor& s = THPVariable_Unpack(o);
    if (!s.defined() || s.layout() != at::kStrided || s.is_nested() || !s.has_storage() || s.is_meta() ||
        s.dim() != 1 || s.scalar_type() != at::kFloat || s.size(0) != q.size(1) || (s.size(0) > 1 && s.stride(0) != 1) ||
        s.device() != q.device())
        return false;
    *out = static_cast<const float*>(s.data_ptr());
    return true;
}

// remember(q, k, v, sinks, options, settings, sk_lo, sk_hi, generation, <launch>): run attention()'s later calls of
// this family (q, k, v's), options and settings, with sinks or without as here, with this launch (see parse_spec)
// while the key length stays within [sk_lo, sk_hi] and the launcher accepts the K/V strides. Replaces the entry of
// the same family and options. Takes nothing (returns None) for tensors `call` would not take, options that are not
// simple, or another generation.
PyObject* remember(PyObject*, PyObject* const* a, Py_ssize_t n) {
    if (n != 16 || !PyTuple_Check(a[4]) || PyTuple_GET_SIZE(a[4]) != kOptions || !PyTuple_Check(a[5])) {
        PyErr_Format(PyExc_TypeError, "remember(q, k, v, sinks, options: tuple of %zd, settings: tuple, sk_lo, sk_hi, "
                     "generation, <launch>)", kOptions);
        return nullptr;
    }
    const at::Tensor* t[3];
    const float* sinks = nullptr;
    if (!unpack(a, t) || !sinks_of(a[3], *t[0], &sinks) || PyLong_AsUnsignedLongLong(a[8]) != generation) {
        if (PyErr_Occurred()) PyErr_Clear();
        Py_RETURN_NONE;
    }
    for (Py_ssize_t j = 0; j < kOptions; ++j)
        if (!simple(PyTuple_GET_ITEM(a[4], j))) Py_RETURN_NONE;
    Entry e;
    e.family = family_of(*t[0], *t[1], *t[2]);
    e.sinks = sinks != nullptr;
    e.sk_lo = PyLong_AsLongLong(a[6]);
    const double hi = PyFloat_AsDouble(a[7]);  // math.inf for no upper bound
    e.sk_hi = hi >= 9.2e18 ? INT64_MAX : int64_t(hi);
    if (PyErr_Occurred() || !parse_spec(a + 9, e.spec)) return nullptr;
    for (size_t i = 0; i < entries.size(); ++i) {
        Entry& old = entries[i];
        if (old.family == e.family && old.sinks == e.sinks && same_items(old.options, a[4]) &&
            same_items(old.settings, a[5])) {
            erase_entry(i);
            break;
        }
    }
    if (entries.size() == kEntries) erase_entry(kEntries - 1);
    Py_INCREF(a[4]);
    Py_INCREF(a[5]);
    e.options = a[4];
    e.settings = a[5];
    entries.insert(entries.begin(), e);
    Py_RETURN_NONE;
}

// call(q, k, v, attn_mask, causal, scale, backend, return_lse, out, workspace_bytes, threshold, algo_policy,
//      return_key_mass, key_mass_window, out_layout, window, softcap, sinks): attention()'s arguments; the output of
// a remembered plan's launch, or None (not a remembered family, options or settings; a mask, out=, the LSE or the
// key mass asked for; sinks that are not FP32 (Hq,) on q's device; grad; another stream or device; a graph capture;
// a failed allocation or launch).
PyObject* call(PyObject*, PyObject* const* a, Py_ssize_t n) {
    const at::Tensor* t[3];
    if (n != 18 || entries.empty() || a[3] != Py_None || a[8] != Py_None || !(a[7] == Py_False) ||
        !(a[12] == Py_False) || !unpack(a, t))
        Py_RETURN_NONE;
    const at::Tensor &q = *t[0], &k = *t[1], &v = *t[2];
    const float* sinks = nullptr;
    if (!sinks_of(a[17], q, &sinks)) Py_RETURN_NONE;
    const Family f = family_of(q, k, v);
    const int64_t Sk = k.size(2);
    PyObject* const opts[kOptions] = {a[4], a[5], a[6], a[9], a[10], a[11], a[13], a[14], a[15], a[16]};
    const auto find = [&]() -> size_t {  // nothing in it runs Python code (see same)
        for (size_t i = 0; i < entries.size(); ++i) {
            const Entry& e = entries[i];
            bool hit = e.family == f && e.sinks == (sinks != nullptr);
            for (Py_ssize_t j = 0; j < kOptions && hit; ++j) hit = same(PyTuple_GET_ITEM(e.options, j), opts[j]);
            if (hit) return i;
        }
        return entries.size();
    };
    const size_t i = find();
    if (i == entries.size()) Py_RETURN_NONE;
    const Entry& e = entries[i];
    if (Sk < e.sk_lo || Sk > e.sk_hi || v.size(2) != Sk || !settings_hold(e.settings)) Py_RETURN_NONE;
    // a copy: launch() asks PyTorch for the device and the stream, and another thread could change `entries`
    // meanwhile; a clear() (the scratch moved) shows in the generation
    const LaunchSpec spec = e.spec;
    const uint64_t gen = generation;
    PyObject* out = nullptr;
    switch (launch(spec, gen, f.device, q, k, v, sinks, &out)) {
        case Outcome::kDone:
            return out;
        case Outcome::kFailed: {  // K/V strides the kernel cannot read, or an error: the Python path plans the call
                                  // (and raises attn_lt.native.CudaError where the launch fails)
            const size_t j = find();
            if (j < entries.size()) erase_entry(j);
            Py_RETURN_NONE;
        }
        default:
            Py_RETURN_NONE;
    }
}

void free_bound(PyObject* capsule) { delete static_cast<Bound*>(PyCapsule_GetPointer(capsule, kBound)); }

// bind(q, k, v, generation, <launch>): a handle that runs exactly these tensors' family, key length and K/V strides
// with this launch (AttentionPlan.run's calls), until clear(); None for tensors `run` would not take, or another
// generation (see current_generation).
PyObject* bind(PyObject*, PyObject* const* a, Py_ssize_t n) {
    if (n != 11) {
        PyErr_SetString(PyExc_TypeError, "bind(q, k, v, generation, <launch>)");
        return nullptr;
    }
    const at::Tensor* t[3];
    if (!unpack(a, t) || PyLong_AsUnsignedLongLong(a[3]) != generation) {
        if (PyErr_Occurred()) PyErr_Clear();
        Py_RETURN_NONE;
    }
    auto b = std::make_unique<Bound>();
    b->family = family_of(*t[0], *t[1], *t[2]);
    b->Sk = t[1]->size(2);
    for (int i = 0; i < 4; ++i) {
        b->k_strides[i] = t[1]->stride(i);
        b->v_strides[i] = t[2]->stride(i);
    }
    b->generation = generation;
    if (!parse_spec(a + 4, b->spec)) return nullptr;
    PyObject* capsule = PyCapsule_New(b.get(), kBound, free_bound);
    if (capsule != nullptr) b.release();
    return capsule;
}

// run(handle, q, k, v): the bound launch's output for these tensors, or None (another family, key length or K/V
// strides; grad; another stream or device; a graph capture; cleared since; a failed allocation or launch).
PyObject* run(PyObject*, PyObject* const* a, Py_ssize_t n) {
    const at::Tensor* t[3];
    Bound* b = n == 4 ? static_cast<Bound*>(PyCapsule_GetPointer(a[0], kBound)) : nullptr;
    if (b == nullptr || b->generation != generation || !unpack(a + 1, t)) {
        if (PyErr_Occurred()) PyErr_Clear();
        Py_RETURN_NONE;
    }
    const at::Tensor &q = *t[0], &k = *t[1], &v = *t[2];
    if (k.size(2) != b->Sk || v.size(2) != b->Sk) Py_RETURN_NONE;
    for (int i = 0; i < 4; ++i)
        if (k.stride(i) != b->k_strides[i] || v.stride(i) != b->v_strides[i]) Py_RETURN_NONE;
    if (!(family_of(q, k, v) == b->family)) Py_RETURN_NONE;
    PyObject* out = nullptr;  // b lives through the call: the caller's argument holds its capsule
    switch (launch(b->spec, generation, b->family.device, q, k, v, nullptr, &out)) {
        case Outcome::kDone:
            return out;
        case Outcome::kFailed:
            b->generation = 0;  // never again: the Python path launches and raises attn_lt.native.CudaError
            [[fallthrough]];
        default:
            Py_RETURN_NONE;
    }
}

PyObject* clear(PyObject*, PyObject*) {
    clear_entries();
    Py_RETURN_NONE;
}

// stats() -> (entries, hits)
PyObject* stats(PyObject*, PyObject*) { return Py_BuildValue("(nL)", Py_ssize_t(entries.size()), hits); }

// The module's functions run inside this: a C++ exception (none is expected: the tensors are checked first) gives
// None, "not taken", never a crash; the Python path then takes the call.
template <PyObject* (*F)(PyObject*, PyObject* const*, Py_ssize_t)>
PyObject* guarded(PyObject* self, PyObject* const* a, Py_ssize_t n) {
    try {
        return F(self, a, n);
    } catch (...) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
}

PyMethodDef methods[] = {
    {"configure", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(guarded<configure>)), METH_FASTCALL,
     "configure(current_device, raw_stream, capturing, settings_src, settings_keys)"},
    {"remember", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(guarded<remember>)), METH_FASTCALL,
     "remember a fused plan's launch for its family (see native/fastpath.cpp)"},
    {"call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(guarded<call>)), METH_FASTCALL,
     "attention()'s call through a remembered plan, or None"},
    {"bind", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(guarded<bind>)), METH_FASTCALL,
     "a handle for one plan's run() (see native/fastpath.cpp)"},
    {"run", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(guarded<run>)), METH_FASTCALL,
     "a plan's run() through its handle, or None"},
    {"generation", current_generation, METH_NOARGS, "the scratch's generation (see remember, bind)"},
    {"clear", clear, METH_NOARGS, "forget every remembered plan and invalidate every handle"},
    {"stats", stats, METH_NOARGS, "(entries, hits)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastpath", "attn_lt's cached fused call in C++", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__fastpath() {
    PyObject* m = PyModule_Create(&module);
    if (m == nullptr) return nullptr;
    if (PyModule_AddIntConstant(m, "ARGS_BYTES", long(sizeof(attn_lt_flash_args))) < 0 ||
        PyModule_AddStringConstant(m, "SOURCE_HASH", ATTN_LT_FASTPATH_HASH) < 0) {
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
