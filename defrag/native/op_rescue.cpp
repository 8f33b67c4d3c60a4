// The rescue of an operation that ran out of memory, for a whole program (`defrag run --rescue`;
// `defrag.rescue`): a boxed fallback on a dispatcher mode key that runs every top-level operation of
// the threads that enabled it, and when one fails with c10::OutOfMemoryError, asks Python to compact
// at this safe point (the operation unwound: nothing holds its tensors' addresses but their storages),
// then runs it again, once, with the same arguments. A second failure propagates.
//
// The key is `TESTING_ONLY_GenericMode`, the one mode key PyTorch's dispatcher leaves unused (its
// header reserves it for tests): `enable` refuses when anything else registered a fallback there.
// It sits above autograd and Python's dispatch modes, so a retried operation is recorded once.
//
// Guarantees:
// - Happy path: the arguments are copied (reference counts, no tensor data) and the operation runs
//   with the key excluded, so the operations it calls inside run as they would without the rescue.
// - An operation that writes to an argument (in-place, out=) is never run again: it may have written
//   part of its output before it failed. Its OOM propagates as is.
// - No exception crosses into Python's rescue or out of it: if the rescue fails (raises, or finds
//   nothing to free) the original OutOfMemoryError propagates.
// - Threads: only threads that called `enable` (their dispatcher TLS, inherited by autograd's and
//   parallel regions' workers through PyTorch's ThreadLocalState) are rescued.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <atomic>
#include <string>
#include <vector>

namespace {

namespace py = pybind11;

constexpr c10::DispatchKey kRescueKey = c10::DispatchKey::TESTING_ONLY_GenericMode;

PyObject* g_rescue = nullptr;            // strong, leaked: Python's rescue(addresses) -> bool
torch::Library* g_library = nullptr;     // leaked: the fallback stays registered for the process
std::atomic<int64_t> g_ops_rescued{0};   // operations that failed, were rescued and then succeeded
std::atomic<int64_t> g_ops_failed{0};    // operations whose rescue found nothing or whose retry failed too
std::atomic<int64_t> g_ops_mutating{0};  // OOMs of operations that write an argument: never retried
thread_local int t_rescuing = 0;         // inside Python's rescue on this thread
thread_local int t_retrying = 0;         // running an operation again after a rescue, on this thread

// Every tensor among an operation's arguments (tensors, lists and tuples of them, optional tensors).
void tensors_in(const c10::IValue& v, std::vector<at::Tensor>& out) {
  if (v.isTensor()) {
    if (v.toTensor().defined()) out.push_back(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorVector())
      if (t.defined()) out.push_back(t);
  } else if (v.isList()) {
    for (const c10::IValue& item : v.toListRef()) tensors_in(item, out);
  } else if (v.isTuple()) {
    for (const c10::IValue& item : v.toTupleRef().elements()) tensors_in(item, out);
  }
}

// Python's rescue with the GIL, handed the failed operation's tensor arguments (to pin): true when it
// compacted (the operation may run again). Never throws.
bool ask_python(const c10::SmallVector<c10::IValue, 8>& args) noexcept {
  if (g_rescue == nullptr || t_rescuing > 0 || !Py_IsInitialized()) return false;
  t_rescuing += 1;
  bool made_room = false;
  PyGILState_STATE gil = PyGILState_Ensure();
  try {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    std::vector<at::Tensor> tensors;
    for (const c10::IValue& v : args) tensors_in(v, tensors);
    py::list wrapped;
    for (const at::Tensor& t : tensors) wrapped.append(py::reinterpret_steal<py::object>(THPVariable_Wrap(t)));
    PyObject* said = PyObject_CallOneArg(g_rescue, wrapped.ptr());
    if (said == nullptr) {
      PyErr_WriteUnraisable(g_rescue);  // logged by Python's hook; the OOM propagates
    } else {
      made_room = PyObject_IsTrue(said) == 1;
      Py_DECREF(said);
    }
    PyErr_Clear();
    PyErr_Restore(type, value, traceback);
  } catch (...) {
    PyErr_Clear();  // a wrap that failed: the OOM propagates
    made_room = false;
  }
  PyGILState_Release(gil);
  t_rescuing -= 1;
  return made_room;
}

// While an operation runs again after a rescue (`rescue_retrying`).
struct Retrying {
  Retrying() { t_retrying += 1; }
  ~Retrying() { t_retrying -= 1; }
};

void rescue_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard below(kRescueKey);  // what the operation calls runs without us
  const size_t nargs = op.schema().arguments().size();
  const size_t base = stack->size() - nargs;
  if (t_rescuing > 0) {  // Python's rescue itself runs operations: never rescued again
    op.callBoxed(stack);
    return;
  }
  if (op.schema().is_mutable()) {
    try {
      op.callBoxed(stack);
    } catch (const c10::OutOfMemoryError&) {
      g_ops_mutating += 1;
      throw;
    }
    return;
  }
  c10::SmallVector<c10::IValue, 8> saved(stack->begin() + static_cast<std::ptrdiff_t>(base), stack->end());
  try {
    op.callBoxed(stack);
    return;
  } catch (const c10::OutOfMemoryError&) {
    if (!ask_python(saved)) {
      g_ops_failed += 1;
      throw;
    }
  }
  if (stack->size() > base) stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(base), stack->end());
  for (c10::IValue& v : saved) stack->push_back(std::move(v));
  Retrying again;  // the OOM message of a second failure says what the rescue did (rescue.last_note)
  try {
    op.callBoxed(stack);
  } catch (const c10::OutOfMemoryError&) {
    g_ops_failed += 1;
    throw;
  }
  g_ops_rescued += 1;
}

// With the GIL: the calling thread's operations are rescued through `rescue(addresses) -> bool`
// (the first call registers the fallback; later calls may replace `rescue`).
void enable_rescue(py::object rescue) {
  if (!PyCallable_Check(rescue.ptr())) throw py::type_error("enable_rescue: rescue must be callable");
  if (g_library == nullptr) {
    if (c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(kRescueKey))
      throw std::runtime_error("defrag's operation rescue needs the dispatcher's TESTING_ONLY_GenericMode key, "
                               "and something else in this process registered a fallback there");
    g_library = new torch::Library(torch::Library::IMPL, "_", kRescueKey, __FILE__, __LINE__);
    g_library->fallback(torch::CppFunction::makeFromBoxedFunction<&rescue_fallback>());
  }
  PyObject* old = g_rescue;
  g_rescue = rescue.release().ptr();
  Py_XDECREF(old);
  c10::impl::tls_set_dispatch_key_included(kRescueKey, true);
}

// With the GIL: the calling thread's operations are no longer rescued. False when they were not.
bool disable_rescue() {
  const bool was = c10::impl::tls_is_dispatch_key_included(kRescueKey);
  c10::impl::tls_set_dispatch_key_included(kRescueKey, false);
  return was;
}

py::dict rescue_counters() {
  py::dict out;
  out["enabled_here"] = c10::impl::tls_is_dispatch_key_included(kRescueKey);
  out["rescued"] = g_ops_rescued.load();
  out["failed"] = g_ops_failed.load();
  out["mutating"] = g_ops_mutating.load();
  return out;
}

void bind_op_rescue(py::module_& m) {
  m.def("enable_rescue", &enable_rescue, py::arg("rescue"),
        "Rescue the calling thread's operations that run out of memory (see op_rescue.cpp).");
  m.def("disable_rescue", &disable_rescue, "The calling thread's operations are no longer rescued.");
  m.def("rescue_counters", &rescue_counters);
  m.def("rescue_retrying", []() { return t_retrying > 0; },
        "Whether the calling thread runs an operation again after a rescue (inside its retry).");
}

}  // namespace
