#define PY_SSIZE_T_CLEAN
#include <Python.h>

static struct PyModuleDef jail_module = {PyModuleDef_HEAD_INIT, "_jail", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__jail(void) { return PyModule_Create(&jail_module); }
