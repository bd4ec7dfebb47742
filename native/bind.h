// How a step family's header binds its typed step description to Python, so that adding a family
// (docs/architecture.md, "How to add an op") touches its own header and nothing else in native/:
//
//   * module.cpp includes every header of native/ (CMakeLists.txt generates the list), and calls
//     each registered binder from NB_MODULE;
//   * a family header ends with one line per step description, naming its fields:
//
//       GML_STEP(PoolStep, src, dst, alg, kernel, strides, dilation, pad_l, pad_r, eltwise, name)
//
//     which binds each field by name (a std::optional one also takes None, which clears it) and
//     one ``Plan.add(step)`` overload, and registers that binder (GML_BIND) for module.cpp.
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

#include <optional>
#include <type_traits>
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

template <typename T>
struct is_optional : std::false_type {};
template <typename T>
struct is_optional<std::optional<T>> : std::true_type {};

// Field ``name`` of S, read / written by name; a std::optional field also takes None (clears it).
template <typename S, typename T>
void bind_field(nb::class_<S>& cls, const char* name, T S::*field) {
  if constexpr (is_optional<T>::value)
    cls.def_rw(name, field, nb::arg().none());
  else
    cls.def_rw(name, field);
}

}  // namespace gml_engine

// registers a family's binder (at the end of its header, inside namespace gml_engine)
#define GML_BIND(fn) inline const BindAtLoad fn##_at_load{fn};

// GML_STEP(S, f1, f2, ...): S's binder (its fields by name, plan.add) registered. The field list is
// expanded by a bounded FOR_EACH (as nlohmann/json's NLOHMANN_DEFINE_TYPE_* macros do; C++17 has no
// reflection): up to 24 fields.
#define GML_STEP(S, ...)                                                 \
  inline void bind_##S(Module& m, PlanClass& plan) {                     \
    nb::class_<S> cls = step_class<S>(m, plan, #S);                      \
    GML_FOR_EACH(GML_STEP_FIELD_, S, __VA_ARGS__)                        \
  }                                                                      \
  GML_BIND(bind_##S)
#define GML_STEP_FIELD_(S, f) bind_field<S>(cls, #f, &S::f);

#define GML_FE_1(M, S, x) M(S, x)
#define GML_FE_2(M, S, x, ...) M(S, x) GML_FE_1(M, S, __VA_ARGS__)
#define GML_FE_3(M, S, x, ...) M(S, x) GML_FE_2(M, S, __VA_ARGS__)
#define GML_FE_4(M, S, x, ...) M(S, x) GML_FE_3(M, S, __VA_ARGS__)
#define GML_FE_5(M, S, x, ...) M(S, x) GML_FE_4(M, S, __VA_ARGS__)
#define GML_FE_6(M, S, x, ...) M(S, x) GML_FE_5(M, S, __VA_ARGS__)
#define GML_FE_7(M, S, x, ...) M(S, x) GML_FE_6(M, S, __VA_ARGS__)
#define GML_FE_8(M, S, x, ...) M(S, x) GML_FE_7(M, S, __VA_ARGS__)
#define GML_FE_9(M, S, x, ...) M(S, x) GML_FE_8(M, S, __VA_ARGS__)
#define GML_FE_10(M, S, x, ...) M(S, x) GML_FE_9(M, S, __VA_ARGS__)
#define GML_FE_11(M, S, x, ...) M(S, x) GML_FE_10(M, S, __VA_ARGS__)
#define GML_FE_12(M, S, x, ...) M(S, x) GML_FE_11(M, S, __VA_ARGS__)
#define GML_FE_13(M, S, x, ...) M(S, x) GML_FE_12(M, S, __VA_ARGS__)
#define GML_FE_14(M, S, x, ...) M(S, x) GML_FE_13(M, S, __VA_ARGS__)
#define GML_FE_15(M, S, x, ...) M(S, x) GML_FE_14(M, S, __VA_ARGS__)
#define GML_FE_16(M, S, x, ...) M(S, x) GML_FE_15(M, S, __VA_ARGS__)
#define GML_FE_17(M, S, x, ...) M(S, x) GML_FE_16(M, S, __VA_ARGS__)
#define GML_FE_18(M, S, x, ...) M(S, x) GML_FE_17(M, S, __VA_ARGS__)
#define GML_FE_19(M, S, x, ...) M(S, x) GML_FE_18(M, S, __VA_ARGS__)
#define GML_FE_20(M, S, x, ...) M(S, x) GML_FE_19(M, S, __VA_ARGS__)
#define GML_FE_21(M, S, x, ...) M(S, x) GML_FE_20(M, S, __VA_ARGS__)
#define GML_FE_22(M, S, x, ...) M(S, x) GML_FE_21(M, S, __VA_ARGS__)
#define GML_FE_23(M, S, x, ...) M(S, x) GML_FE_22(M, S, __VA_ARGS__)
#define GML_FE_24(M, S, x, ...) M(S, x) GML_FE_23(M, S, __VA_ARGS__)
#define GML_FE_PICK(_1, _2, _3, _4, _5, _6, _7, _8, _9, _10, _11, _12, _13, _14, _15, _16, _17, _18, _19, _20, \
                    _21, _22, _23, _24, NAME, ...)                                                         \
  NAME
#define GML_FOR_EACH(M, S, ...)                                                                              \
  GML_FE_PICK(__VA_ARGS__, GML_FE_24, GML_FE_23, GML_FE_22, GML_FE_21, GML_FE_20, GML_FE_19, GML_FE_18,     \
              GML_FE_17, GML_FE_16, GML_FE_15, GML_FE_14, GML_FE_13, GML_FE_12, GML_FE_11, GML_FE_10, GML_FE_9, \
              GML_FE_8, GML_FE_7, GML_FE_6, GML_FE_5, GML_FE_4, GML_FE_3, GML_FE_2, GML_FE_1)                  \
  (M, S, __VA_ARGS__)
