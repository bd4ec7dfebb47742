// How a step family's header binds its typed step description to Python, so that adding a family
// (docs/architecture.md, "How to add an op") touches its own header and nothing else in native/:
//
//   * module.cpp includes every header of native/ (CMakeLists.txt generates the list), and calls
//     each registered binder from NB_MODULE;
//   * a family header ends with its binder and one GML_BIND line:
//
//       inline void bind_pool(Module& m, PlanClass& plan) {
//         step_class<PoolStep>(m, plan, "PoolStep").GML_FIELD(PoolStep, src).GML_FIELD(PoolStep, dst) ...;
//       }
//       GML_BIND(bind_pool)
//
// A step description class is default-constructible with every field read / written by name, and
// ``plan.add(step)`` builds it (the ``build`` overload of the family header): Python fills it by
// field name (gml/runtime/plan_steps.py), so a misspelt field is an AttributeError there, never a
// shifted positional argument here.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <vector>

#include "plan.h"

namespace gml_engine {

namespace nb = nanobind;
using Module = nb::module_;
using PlanClass = nb::class_<Plan>;
using Binder = void (*)(Module&, PlanClass&);

// Every family's binder, in include order (filled during static initialization, before the
// interpreter calls the module's init function).
inline std::vector<Binder>& binders() {
  static std::vector<Binder> all;
  return all;
}

struct BindAtLoad {
  explicit BindAtLoad(Binder b) { binders().push_back(b); }
};

// A step description class: default-constructible, and ``plan.add(step)`` building it.
template <typename S>
nb::class_<S> step_class(Module& m, PlanClass& plan, const char* name) {
  plan.def("add", [](Plan& p, const S& s) { build(p, s); }, nb::arg("step"));
  return nb::class_<S>(m, name).def(nb::init<>());
}

}  // namespace gml_engine

// a field read / written by name
#define GML_FIELD(S, f) def_rw(#f, &S::f)
// an optional field: None clears it
#define GML_OPT(S, f) def_rw(#f, &S::f, nb::arg().none())
// registers a family's binder (at the end of its header, inside namespace gml_engine)
#define GML_BIND(fn) inline const BindAtLoad fn##_at_load{fn};
