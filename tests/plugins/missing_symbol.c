/* Test plugin: a shared library without any entry point (built with hidden visibility). */
#include "hydrahead/plugin.h"

int hh_test_not_an_entry(void) { return 1; }
