// ggml.c refers to three backend functions that quantisation never reaches;
// kvcache-llamacpp-requantize links ggml.c without ggml's backends, so these
// stand in for them and abort if ever called.
#include <stdio.h>
#include <stdlib.h>

#include "ggml-backend.h"

static void Unreachable(const char* fn) {
  fprintf(stderr, "%s: ggml backends are not linked into kvcache-llamacpp-requantize\n", fn);
  abort();
}

enum ggml_backend_buffer_usage ggml_backend_buffer_get_usage(ggml_backend_buffer_t buffer) {
  (void)buffer;
  Unreachable(__func__);
  return GGML_BACKEND_BUFFER_USAGE_ANY;
}

void ggml_backend_tensor_memset(struct ggml_tensor* tensor, uint8_t value, size_t offset, size_t size) {
  (void)tensor, (void)value, (void)offset, (void)size;
  Unreachable(__func__);
}

void ggml_backend_tensor_set(struct ggml_tensor* tensor, const void* data, size_t offset, size_t size) {
  (void)tensor, (void)data, (void)offset, (void)size;
  Unreachable(__func__);
}
