// Launch plans: the native half of cpattn_common.launch_plans (read that module's docstring
// first). Built at run time by cpattn_common.native_build against torch's headers only (no
// CUDA headers, no link to libcuda: cuLaunchKernel is found with dlopen, as Triton does).
//
// A plan belongs to one op and one call key: the current device plus the metadata of every
// argument (tensor: exact torch.Tensor class, dtype, device, sizes, strides, pointer alignment
// mod 16, neg/conj bits; int / bool / float: value; None). The op's Python path validated
// and ran one call with that key under a recorder; the plan holds what that call did: the
// outputs it allocated and the kernels it launched, each launch parameter tied to an argument
// tensor's pointer, an allocated output's pointer, or a constant. A later call with the same
// key allocates and launches the same way without running Python; any other call misses.
//
// Nothing throws into Python: every entry point catches and sets a Python exception. A
// failure before the first launch (an allocation) is reported as a miss, so that the Python
// path runs and raises torch's own error.

#include <Python.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/python_variable.h>

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace {

// cuLaunchKernel's and cuCtxGetCurrent's signatures with the driver's handle types as void*.
using LaunchFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         unsigned, void*, void**, void**);
using CtxGetCurrentFn = int (*)(void**);

enum KeyTag : int64_t { kTensor = 1, kInt = 2, kBool = 3, kFloat = 4, kNone = 5 };
enum ParamKind : int { kArgPtr = 0, kOutPtr = 1, kConst = 2 };
constexpr size_t kMaxParams = 64;
// Table sizes (set_limits changes them, for tests). A full plan table evicts (make_room); a
// full set of keys met once is cleared, which costs those keys one more Python-path call
// before their recording.
size_t max_plans = 8192;
// Keys met once and not yet recorded (a key is recorded at its second call: recording costs
// several Python-path calls, so keys that never repeat, such as one-off prefill shapes, must
// not pay for it).
size_t max_seen = 16384;

struct Param {
  int kind;
  int index;      // argument position (kArgPtr) or allocation index (kOutPtr)
  int64_t value;  // byte offset (pointers) or the constant's bits (little-endian)
};

struct Launch {
  void* function;
  unsigned grid[3];
  unsigned block;
  unsigned shared;
  std::vector<Param> params;
};

struct Alloc {
  std::vector<int64_t> sizes;
  at::ScalarType dtype;
  int like;  // argument whose device (and layout) the allocation takes
};

struct Plan {
  bool ready = false;  // false: only failed recordings are counted under this key
  uint64_t last_used = 0;  // use_clock at its latest replay, recording or refusal
  int64_t failures = 0;
  int64_t device = -1;
  std::vector<Alloc> allocs;
  std::vector<Launch> launches;
  std::vector<int> returns;
};

struct KeyHash {
  size_t operator()(const std::vector<int64_t>& key) const noexcept {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the words
    for (int64_t w : key) {
      h ^= static_cast<uint64_t>(w);
      h *= 1099511628211ull;
    }
    return static_cast<size_t>(h);
  }
};

// Plans are shared: a replay holds its own reference while it calls back into Python (the
// device and stream getters), during which another thread may register, refuse or clear.
std::unordered_map<std::vector<int64_t>, std::shared_ptr<Plan>, KeyHash> plans;
std::unordered_set<std::vector<int64_t>, KeyHash> seen;
std::vector<int64_t> key_buffer;  // reused: every entry point runs under the GIL
PyObject* get_device = nullptr;     // () -> int, the current CUDA device
PyObject* get_stream = nullptr;     // (device) -> int, its current stream
PyObject* alloc_globals = nullptr;  // cpattn_common.alloc's namespace: its _poison
PyObject* hook_knobs = nullptr;     // triton.knobs.runtime (None: no hooks to look at)
PyObject* hook_chain = nullptr;     // the HookChain type (None on Tritons without it)
PyObject* dry_log = nullptr;      // a list: launches are appended there instead of run
LaunchFn launch_fn = nullptr;
CtxGetCurrentFn ctx_get_current_fn = nullptr;
int64_t n_hits = 0;
int64_t n_misses = 0;
int64_t n_evicted = 0;

// Ticks at every replay, recording and refusal of a key in the plan table (Plan::last_used).
uint64_t use_clock = 0;

// Makes room for one more key in a full plan table: the least recently used quarter goes (at
// least one key), so a working set of up to three quarters of the table that keeps being
// replayed is never flushed by a stream of new keys, whatever their order. One O(table) walk
// and selection per eviction, paid for by the insertions that filled the table again.
void make_room() {
  if (plans.size() < max_plans) return;
  const size_t keep = max_plans - std::max<size_t>(1, max_plans / 4);
  const size_t drop = plans.size() - keep;
  std::vector<uint64_t> ages;
  ages.reserve(plans.size());
  for (const auto& kv : plans) ages.push_back(kv.second->last_used);
  std::nth_element(ages.begin(), ages.begin() + static_cast<std::ptrdiff_t>(drop - 1), ages.end());
  const uint64_t newest_dropped = ages[drop - 1];  // ticks are unique: exactly `drop` go
  for (auto it = plans.begin(); it != plans.end();) {
    it = it->second->last_used <= newest_dropped ? plans.erase(it) : std::next(it);
  }
  n_evicted += static_cast<int64_t>(drop);
}

// The key of (op, current device, args); false when an argument is of a kind plans never
// cover.
bool build_key(int64_t op, int64_t device, PyObject* const* args, Py_ssize_t nargs,
               std::vector<int64_t>& key) {
  key.clear();
  key.push_back(op);
  key.push_back(device);
  key.push_back(nargs);
  for (Py_ssize_t i = 0; i < nargs; ++i) {
    PyObject* obj = args[i];
    if (Py_TYPE(obj) == reinterpret_cast<PyTypeObject*>(THPVariableClass)) {
      const at::Tensor& t = THPVariable_Unpack(obj);
      if (!t.defined() || t.layout() != at::kStrided || !t.has_storage()) return false;
      const at::Device dev = t.device();
      // A CUDA tensor off the current device: no key, so the call takes the Python path,
      // which makes the tensor's device current (cpattn_common.device) before it launches.
      if (dev.is_cuda() && dev.index() != device) return false;
      key.push_back(kTensor);
      key.push_back(static_cast<int64_t>(t.scalar_type()));
      key.push_back(static_cast<int64_t>(dev.type()));
      key.push_back(dev.index());
      key.push_back(static_cast<int64_t>(t.is_neg()) | (static_cast<int64_t>(t.is_conj()) << 1));
      key.push_back(t.dim());
      for (int64_t s : t.sizes()) key.push_back(s);
      for (int64_t s : t.strides()) key.push_back(s);
      key.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()) & 15));
    } else if (obj == Py_True || obj == Py_False) {
      key.push_back(kBool);
      key.push_back(obj == Py_True);
    } else if (PyLong_CheckExact(obj)) {
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
      if (overflow != 0 || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return false;
      }
      key.push_back(kInt);
      key.push_back(v);
    } else if (PyFloat_CheckExact(obj)) {
      const double v = PyFloat_AS_DOUBLE(obj);
      int64_t bits;
      std::memcpy(&bits, &v, sizeof bits);
      key.push_back(kFloat);
      key.push_back(bits);
    } else if (obj == Py_None) {
      key.push_back(kNone);
    } else {
      return false;
    }
  }
  return true;
}

bool int_arg(PyObject* obj, const char* what, int64_t* out) {
  const long long v = PyLong_AsLongLong(obj);
  if (v == -1 && PyErr_Occurred()) {
    PyErr_Format(PyExc_TypeError, "%s must be an int", what);
    return false;
  }
  *out = v;
  return true;
}

// Calls get_device() / get_stream(device); -1 / nullptr with a Python error set on failure.
int64_t current_device() {
  if (get_device == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "launch plans: set_runtime was not called");
    return -1;
  }
  PyObject* res = PyObject_CallNoArgs(get_device);
  if (res == nullptr) return -1;
  const long long v = PyLong_AsLongLong(res);
  Py_DECREF(res);
  return v;
}

bool current_stream(int64_t device, void** stream) {
  PyObject* dev = PyLong_FromLongLong(device);
  if (dev == nullptr) return false;
  PyObject* res = PyObject_CallOneArg(get_stream, dev);
  Py_DECREF(dev);
  if (res == nullptr) return false;
  *stream = PyLong_AsVoidPtr(res);
  Py_DECREF(res);
  return !PyErr_Occurred();
}

bool resolve_launch() {
  if (launch_fn != nullptr) return true;
  void* lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (lib == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "launch plans: cannot open libcuda.so.1");
    return false;
  }
  launch_fn = reinterpret_cast<LaunchFn>(dlsym(lib, "cuLaunchKernel"));
  ctx_get_current_fn = reinterpret_cast<CtxGetCurrentFn>(dlsym(lib, "cuCtxGetCurrent"));
  if (launch_fn == nullptr || ctx_get_current_fn == nullptr) {
    launch_fn = nullptr;
    PyErr_SetString(PyExc_RuntimeError,
                    "launch plans: libcuda.so.1 has no cuLaunchKernel / cuCtxGetCurrent");
    return false;
  }
  return true;
}

// Whether this thread has a current CUDA context. Triton's launcher makes the device's
// primary context current before its first launch in a thread; a replay does not, so a
// thread whose first CUDA work would be a replay takes the Python path once instead.
bool context_current() {
  void* ctx = nullptr;
  return ctx_get_current_fn(&ctx) == 0 && ctx != nullptr;
}

// What the Python path checks before a cached launch, here before a replay: output poisoning
// is off (cpattn_common.alloc._poison is None) and no Triton launch hook is installed (each
// hook None, or a HookChain with no calls); also no recording is running
// (cpattn_common.alloc._recorder is None). -1 with a Python error set on failure.
int replay_allowed() {
  // Interned once: a look-up by a fresh string would cost more than the rest of the check.
  static PyObject* const poison_name = PyUnicode_InternFromString("_poison");
  static PyObject* const hook_names[] = {PyUnicode_InternFromString("launch_enter_hook"),
                                         PyUnicode_InternFromString("launch_exit_hook")};
  static PyObject* const calls_name = PyUnicode_InternFromString("calls");
  static PyObject* const recorder_name = PyUnicode_InternFromString("_recorder");
  if (alloc_globals != nullptr) {
    PyObject* poison = PyDict_GetItemWithError(alloc_globals, poison_name);  // borrowed
    if (poison == nullptr && PyErr_Occurred()) return -1;
    if (poison != nullptr && poison != Py_None) return 0;
    // A recording is running (in any thread): an op called inside the recorded one must take
    // its Python path, whose launches the recorder sees; replayed natively, they would be
    // missing from the plan being recorded.
    PyObject* rec = PyDict_GetItemWithError(alloc_globals, recorder_name);  // borrowed
    if (rec == nullptr && PyErr_Occurred()) return -1;
    if (rec != nullptr && rec != Py_None) return 0;
  }
  if (hook_knobs == nullptr || hook_knobs == Py_None) return 1;
  for (PyObject* name : hook_names) {
    PyObject* hook = PyObject_GetAttr(hook_knobs, name);
    if (hook == nullptr) return -1;
    int idle = hook == Py_None;
    if (!idle && hook_chain != nullptr && hook_chain != Py_None &&
        Py_TYPE(hook) == reinterpret_cast<PyTypeObject*>(hook_chain)) {
      PyObject* calls = PyObject_GetAttr(hook, calls_name);
      const Py_ssize_t n = calls == nullptr ? -1 : PyObject_Length(calls);
      Py_XDECREF(calls);
      if (n < 0) {
        Py_DECREF(hook);
        return -1;
      }
      idle = n == 0;
    }
    Py_DECREF(hook);
    if (!idle) return 0;
  }
  return 1;
}

int64_t pointer_of(const at::Tensor& t, int64_t offset) {
  return static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr())) + offset;
}

// replay(op, *args) -> tuple of outputs (hit), None (a miss to record: the key's second
// call), False (a miss not to record: the key's first call, a refused key, arguments plans do
// not key, output poisoning on, a Triton launch hook installed, no current CUDA context)
PyObject* replay(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  try {
    if (nargs < 1) {
      PyErr_SetString(PyExc_TypeError, "replay(op, *args)");
      return nullptr;
    }
    int64_t op;
    if (!int_arg(args[0], "op", &op)) return nullptr;
    const int allowed = replay_allowed();
    if (allowed < 0) return nullptr;
    if (allowed == 0) {
      ++n_misses;
      Py_RETURN_FALSE;  // the Python path poisons or calls the hook; nothing to record
    }
    const int64_t device = current_device();
    if (device == -1 && PyErr_Occurred()) return nullptr;
    if (!build_key(op, device, args + 1, nargs - 1, key_buffer)) {
      ++n_misses;
      Py_RETURN_FALSE;
    }
    auto it = plans.find(key_buffer);
    if (it == plans.end()) {
      ++n_misses;
      if (seen.erase(key_buffer) != 0) Py_RETURN_NONE;  // its second call: record it
      if (seen.size() >= max_seen) seen.clear();
      seen.insert(key_buffer);
      Py_RETURN_FALSE;
    }
    it->second->last_used = ++use_clock;
    if (!it->second->ready) {
      ++n_misses;
      if (it->second->failures < 0) Py_RETURN_FALSE;  // refused key
      Py_RETURN_NONE;
    }
    const std::shared_ptr<const Plan> held = it->second;
    const Plan& plan = *held;
    // The dry-run list as it is now, held for the whole replay: the Python callbacks below
    // (stream getter, allocator hooks, finalizers) may call set_dry_run.
    struct Ref {
      PyObject* p;
      ~Ref() { Py_XDECREF(p); }
    } log{dry_log};
    Py_XINCREF(log.p);
    if (device != plan.device) {  // not expected: the key holds the current device
      ++n_misses;
      Py_RETURN_FALSE;
    }
    if (log.p == nullptr && !plan.launches.empty()) {
      if (!resolve_launch()) return nullptr;
      if (!context_current()) {
        ++n_misses;
        Py_RETURN_FALSE;
      }
    }
    void* stream = nullptr;
    if (!current_stream(device, &stream)) return nullptr;
    std::vector<at::Tensor> outs;
    outs.reserve(plan.allocs.size());
    try {
      for (const Alloc& a : plan.allocs) {
        const at::Tensor& like = THPVariable_Unpack(args[1 + a.like]);
        outs.push_back(at::empty(a.sizes, like.options().dtype(a.dtype)));
      }
    } catch (...) {
      ++n_misses;  // e.g. out of memory: the Python path raises torch's own error
      Py_RETURN_NONE;
    }
    int64_t values[kMaxParams];
    void* params[kMaxParams];
    for (const Launch& l : plan.launches) {
      size_t k = 0;
      for (const Param& p : l.params) {
        if (p.kind == kArgPtr) {
          values[k] = pointer_of(THPVariable_Unpack(args[1 + p.index]), p.value);
        } else if (p.kind == kOutPtr) {
          values[k] = pointer_of(outs[p.index], p.value);
        } else {
          values[k] = p.value;
        }
        params[k] = &values[k];
        ++k;
      }
      if (log.p != nullptr) {
        PyObject* vals = PyTuple_New(static_cast<Py_ssize_t>(k));
        if (vals == nullptr) return nullptr;
        for (size_t j = 0; j < k; ++j) {
          PyTuple_SET_ITEM(vals, j, PyLong_FromLongLong(values[j]));
        }
        PyObject* entry = Py_BuildValue(
            "(K(III)IIKN)", static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(l.function)),
            l.grid[0], l.grid[1], l.grid[2], l.block, l.shared,
            static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(stream)), vals);
        if (entry == nullptr || PyList_Append(log.p, entry) != 0) {
          Py_XDECREF(entry);
          return nullptr;
        }
        Py_DECREF(entry);
        continue;
      }
      const int rc = launch_fn(l.function, l.grid[0], l.grid[1], l.grid[2], l.block, 1, 1,
                               l.shared, stream, params, nullptr);
      if (rc != 0) {
        PyErr_Format(PyExc_RuntimeError, "launch plans: cuLaunchKernel failed (CUresult %d)", rc);
        return nullptr;
      }
    }
    ++n_hits;
    PyObject* result = PyTuple_New(static_cast<Py_ssize_t>(plan.returns.size()));
    if (result == nullptr) return nullptr;
    for (size_t j = 0; j < plan.returns.size(); ++j) {
      PyObject* t = THPVariable_Wrap(outs[plan.returns[j]]);
      if (t == nullptr) {
        Py_DECREF(result);
        return nullptr;
      }
      PyTuple_SET_ITEM(result, j, t);
    }
    return result;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "launch plans: unknown C++ exception");
    return nullptr;
  }
}

// Parses one element of a sequence as an int64 (false with a Python error set).
bool seq_int(PyObject* seq, Py_ssize_t i, const char* what, int64_t* out) {
  PyObject* item = PySequence_GetItem(seq, i);
  if (item == nullptr) return false;
  const bool ok = int_arg(item, what, out);
  Py_DECREF(item);
  return ok;
}

bool parse_ints(PyObject* seq, const char* what, std::vector<int64_t>* out) {
  const Py_ssize_t n = PySequence_Size(seq);
  if (n < 0) return false;
  out->resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!seq_int(seq, i, what, &(*out)[i])) return false;
  }
  return true;
}

// register(op, device, args, allocs, launches, returns): allocs = [(sizes, dtype_code, like)],
// launches = [(function, (gx, gy, gz), block, shared, [(kind, index, value), ...])].
PyObject* register_plan(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  try {
    if (nargs != 6 || !PyTuple_Check(args[2])) {
      PyErr_SetString(PyExc_TypeError,
                      "register(op, device, args: tuple, allocs, launches, returns)");
      return nullptr;
    }
    int64_t op, device;
    if (!int_arg(args[0], "op", &op) || !int_arg(args[1], "device", &device)) return nullptr;
    PyObject* call_args = args[2];
    const Py_ssize_t n_call = PyTuple_GET_SIZE(call_args);
    std::vector<int64_t> key;
    if (!build_key(op, device, &PyTuple_GET_ITEM(call_args, 0), n_call, key)) {
      PyErr_SetString(PyExc_ValueError, "launch plans: arguments of a kind plans do not key");
      return nullptr;
    }
    Plan plan;
    plan.ready = true;
    plan.device = device;
    const Py_ssize_t n_allocs = PySequence_Size(args[3]);
    if (n_allocs < 0) return nullptr;
    for (Py_ssize_t i = 0; i < n_allocs; ++i) {
      PyObject* item = PySequence_GetItem(args[3], i);
      if (item == nullptr) return nullptr;
      PyObject* sizes = nullptr;
      long long dtype = 0;
      int like = 0;
      const bool ok = PyArg_ParseTuple(item, "OLi", &sizes, &dtype, &like);
      Alloc a;
      const bool parsed = ok && parse_ints(sizes, "allocation size", &a.sizes);
      Py_DECREF(item);
      if (!parsed) return nullptr;
      if (like < 0 || like >= n_call ||
          Py_TYPE(PyTuple_GET_ITEM(call_args, like)) !=
              reinterpret_cast<PyTypeObject*>(THPVariableClass)) {
        PyErr_SetString(PyExc_ValueError, "launch plans: an allocation's like is not a tensor argument");
        return nullptr;
      }
      a.dtype = static_cast<at::ScalarType>(dtype);
      a.like = like;
      plan.allocs.push_back(std::move(a));
    }
    const Py_ssize_t n_launches = PySequence_Size(args[4]);
    if (n_launches < 0) return nullptr;
    for (Py_ssize_t i = 0; i < n_launches; ++i) {
      PyObject* item = PySequence_GetItem(args[4], i);
      if (item == nullptr) return nullptr;
      unsigned long long function = 0;
      unsigned gx = 0, gy = 0, gz = 0, block = 0, shared = 0;
      PyObject* params = nullptr;
      const bool ok =
          PyArg_ParseTuple(item, "K(III)IIO", &function, &gx, &gy, &gz, &block, &shared, &params);
      Launch l{reinterpret_cast<void*>(static_cast<uintptr_t>(function)), {gx, gy, gz}, block,
               shared, {}};
      bool parsed = ok;
      const Py_ssize_t n_params = ok ? PySequence_Size(params) : -1;
      if (parsed && (n_params < 0 || static_cast<size_t>(n_params) > kMaxParams)) {
        if (n_params >= 0) PyErr_SetString(PyExc_ValueError, "launch plans: too many parameters");
        parsed = false;
      }
      for (Py_ssize_t j = 0; parsed && j < n_params; ++j) {
        PyObject* p = PySequence_GetItem(params, j);
        int kind = 0, index = 0;
        long long value = 0;
        parsed = p != nullptr && PyArg_ParseTuple(p, "iiL", &kind, &index, &value);
        Py_XDECREF(p);
        if (parsed && !((kind == kArgPtr && index >= 0 && index < n_call &&
                         Py_TYPE(PyTuple_GET_ITEM(call_args, index)) ==
                             reinterpret_cast<PyTypeObject*>(THPVariableClass)) ||
                        (kind == kOutPtr && index >= 0 && index < n_allocs) || kind == kConst)) {
          PyErr_SetString(PyExc_ValueError, "launch plans: a parameter refers to nothing");
          parsed = false;
        }
        if (parsed) l.params.push_back(Param{kind, index, value});
      }
      Py_DECREF(item);
      if (!parsed) return nullptr;
      plan.launches.push_back(std::move(l));
    }
    std::vector<int64_t> returns;
    if (!parse_ints(args[5], "return index", &returns)) return nullptr;
    for (int64_t r : returns) {
      if (r < 0 || r >= n_allocs) {
        PyErr_SetString(PyExc_ValueError, "launch plans: a return index is not an allocation");
        return nullptr;
      }
      plan.returns.push_back(static_cast<int>(r));
    }
    if (plans.find(key) == plans.end()) make_room();
    plan.last_used = ++use_clock;
    plans[std::move(key)] = std::make_shared<Plan>(std::move(plan));
    Py_RETURN_NONE;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "launch plans: unknown C++ exception");
    return nullptr;
  }
}

// refuse(op, args, limit): counts a failed recording under the key (with the current device);
// after `limit` of them the key is refused (replay returns False, and the op stops trying to
// record it).
PyObject* refuse(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  try {
    if (nargs != 3 || !PyTuple_Check(args[1])) {
      PyErr_SetString(PyExc_TypeError, "refuse(op, args: tuple, limit)");
      return nullptr;
    }
    int64_t op, limit;
    if (!int_arg(args[0], "op", &op) || !int_arg(args[2], "limit", &limit)) return nullptr;
    const int64_t device = current_device();
    if (device == -1 && PyErr_Occurred()) return nullptr;
    std::vector<int64_t> key;
    if (!build_key(op, device, &PyTuple_GET_ITEM(args[1], 0), PyTuple_GET_SIZE(args[1]), key)) {
      Py_RETURN_NONE;
    }
    if (plans.find(key) == plans.end()) make_room();
    std::shared_ptr<Plan>& slot = plans[std::move(key)];
    if (!slot) slot = std::make_shared<Plan>();
    slot->last_used = ++use_clock;
    if (!slot->ready && slot->failures >= 0 && ++slot->failures >= limit) slot->failures = -1;
    Py_RETURN_NONE;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "launch plans: unknown C++ exception");
    return nullptr;
  }
}

void replace_ref(PyObject** slot, PyObject* value) {
  Py_XINCREF(value);
  Py_XDECREF(*slot);
  *slot = value;
}

// set_runtime(get_device, get_stream, alloc_globals=None, hook_knobs=None, hook_chain=None)
PyObject* set_runtime(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 2 || nargs > 5 || !PyCallable_Check(args[0]) || !PyCallable_Check(args[1]) ||
      (nargs > 2 && args[2] != Py_None && !PyDict_Check(args[2]))) {
    PyErr_SetString(PyExc_TypeError,
                    "set_runtime(get_device, get_stream, alloc_globals: dict | None = None, "
                    "hook_knobs=None, hook_chain=None)");
    return nullptr;
  }
  replace_ref(&get_device, args[0]);
  replace_ref(&get_stream, args[1]);
  replace_ref(&alloc_globals, nargs > 2 && args[2] != Py_None ? args[2] : nullptr);
  replace_ref(&hook_knobs, nargs > 3 ? args[3] : nullptr);
  replace_ref(&hook_chain, nargs > 4 ? args[4] : nullptr);
  Py_RETURN_NONE;
}

PyObject* set_dry_run(PyObject*, PyObject* arg) {
  if (arg != Py_None && !PyList_Check(arg)) {
    PyErr_SetString(PyExc_TypeError, "set_dry_run(list | None)");
    return nullptr;
  }
  Py_XINCREF(arg == Py_None ? nullptr : arg);
  Py_XDECREF(dry_log);
  dry_log = arg == Py_None ? nullptr : arg;
  Py_RETURN_NONE;
}

PyObject* clear(PyObject*, PyObject*) {
  plans.clear();
  seen.clear();
  n_hits = n_misses = n_evicted = 0;
  Py_RETURN_NONE;
}

// set_limits(max_plans, max_seen) -> the previous (max_plans, max_seen); both >= 1.
PyObject* set_limits(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  int64_t new_plans = 0, new_seen = 0;
  if (nargs != 2 || !int_arg(args[0], "max_plans", &new_plans) ||
      !int_arg(args[1], "max_seen", &new_seen)) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "set_limits(max_plans, max_seen)");
    return nullptr;
  }
  if (new_plans < 1 || new_seen < 1) {
    PyErr_SetString(PyExc_ValueError, "set_limits: both limits must be >= 1");
    return nullptr;
  }
  PyObject* previous = Py_BuildValue("(nn)", static_cast<Py_ssize_t>(max_plans),
                                     static_cast<Py_ssize_t>(max_seen));
  if (previous == nullptr) return nullptr;
  max_plans = static_cast<size_t>(new_plans);
  max_seen = static_cast<size_t>(new_seen);
  return previous;
}

PyObject* info(PyObject*, PyObject*) {
  int64_t ready = 0, refused = 0;
  for (const auto& kv : plans) {
    ready += kv.second->ready;
    refused += !kv.second->ready && kv.second->failures < 0;
  }
  return Py_BuildValue("{sLsLsLsLsLsL}", "plans", static_cast<long long>(ready), "refused",
                       static_cast<long long>(refused), "seen_once",
                       static_cast<long long>(seen.size()), "hits",
                       static_cast<long long>(n_hits), "misses",
                       static_cast<long long>(n_misses), "evicted",
                       static_cast<long long>(n_evicted));
}

PyObject* dtype_code(PyObject*, PyObject* arg) {
  if (!THPVariable_Check(arg)) {
    PyErr_SetString(PyExc_TypeError, "dtype_code(tensor)");
    return nullptr;
  }
  return PyLong_FromLong(static_cast<long>(THPVariable_Unpack(arg).scalar_type()));
}

PyMethodDef methods[] = {
    {"replay", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(replay)), METH_FASTCALL,
     "replay(op, *args) -> tuple | None | False"},
    {"register", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(register_plan)),
     METH_FASTCALL, "register(op, device, args, allocs, launches, returns)"},
    {"refuse", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(refuse)), METH_FASTCALL,
     "refuse(op, args, limit)"},
    {"set_runtime", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(set_runtime)),
     METH_FASTCALL, "set_runtime(get_device, get_stream, alloc_globals, hook_knobs, hook_chain)"},
    {"set_dry_run", set_dry_run, METH_O, "set_dry_run(list | None)"},
    {"clear", clear, METH_NOARGS, "forget every plan and counter"},
    {"set_limits", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(set_limits)),
     METH_FASTCALL, "set_limits(max_plans, max_seen) -> previous (max_plans, max_seen)"},
    {"info", info, METH_NOARGS, "counters"},
    {"dtype_code", dtype_code, METH_O, "the ScalarType code of a tensor's dtype"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "launch_plans", nullptr, -1, methods};

}  // namespace

#define CPATTN_CONCAT2(a, b) a##b
#define CPATTN_CONCAT(a, b) CPATTN_CONCAT2(a, b)

PyMODINIT_FUNC CPATTN_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  return PyModule_Create(&module_def);
}
