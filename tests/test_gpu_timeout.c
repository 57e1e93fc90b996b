/*
 * test_gpu_timeout.c -- a rank that never arrives (SPEC §5: a forward never hangs). The CUDA backend's
 * R ranks on one GPU meet at the cross-rank barrier the NCCL backend waits at, with one rank held back
 * by the test hold (mm_test_hold_rank, src/internal.h): its block leaves the barrier without arriving.
 * For R = 2 and 4 and timeout_ms = 200 and 1000:
 *   - megamoe_layer_check returns MEGAMOE_ERR_TIMEOUT no sooner than timeout_ms and within timeout_ms + 1 s
 *     of the forward's call (the forward's two barriers wait once, not twice), its message naming the rank
 *     that did not arrive and timeout_ms;
 *   - nothing traps: no CUDA error is pending and the device synchronizes cleanly afterwards;
 *   - y after a timeout is not valid (SPEC §5, the message says so): it is poisoned with NaN before and
 *     not read after;
 *   - the context serves what follows: the timed-out layer is destroyed and a fresh layer of the same
 *     shape made; its forward is bitwise equal to a layer's in a group that never held a rank, and within
 *     relative L2 1e-3 of the CPU backend. With timeout_ms = 200 a second layer of the shape stays alive
 *     throughout, so the group's buffer survives and the fresh layer reuses the barrier words the timeout
 *     left unequal; with 1000 the buffer goes with the layer and is made anew. On the reused buffer the
 *     fresh layer then times out once more with another rank held, and forwards correctly again after.
 * Exits 77 (ctest: skipped, and said so) without a usable sm_90 GPU or without the CUDA backend.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>
#include <cuda_runtime_api.h>

#include "internal.h"
#include "test_util.h"

#define CK(call)                                                                                             \
    do {                                                                                                     \
        cudaError_t e_ = (call);                                                                             \
        if (e_ != cudaSuccess) fail_msg("%s: %s", #call, cudaGetErrorString(e_));                            \
    } while (0)

enum { E = 8, K = 2, H = 256, I = 256, T = 40, T_MAX = 32 };

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static megamoe_group *make_group(megamoe_backend backend, int R) {
    megamoe_group_config gc;
    megamoe_group_config_init(&gc);
    gc.backend = backend;
    gc.num_ranks = R;
    megamoe_group *g = NULL;
    if (megamoe_group_create(&gc, &g)) fail_msg("group: %s", megamoe_group_last_error(g));
    return g;
}

static megamoe_layer *make_layer(megamoe_group *g, const tu_model *m, int timeout_ms) {
    megamoe_layer_config c = m->cfg;
    c.timeout_ms = timeout_ms;
    megamoe_layer *l = NULL;
    megamoe_status st = megamoe_layer_create(g, &c, &l);
    if (st == MEGAMOE_OK) st = tu_model_load(m, l);
    if (st == MEGAMOE_OK) st = megamoe_layer_finalize(l);
    if (st) fail_msg("layer: %s", megamoe_layer_last_error(l));
    return l;
}

/* Device copies of the inputs and of y. */
typedef struct dev_io {
    uint16_t *x, *y;
    int32_t *ids;
    float *w;
    uint8_t *pad;
} dev_io;

/* The T tokens split over the R ranks in contiguous chunks (as tu_forward), y poisoned with NaN first;
 * returns the forward's status. */
static megamoe_status forward(megamoe_layer *l, int R, const dev_io *d) {
    CK(cudaMemset(d->y, 0xFF, (size_t)T * H * 2)); /* bf16 0xFFFF: NaN */
    const int chunk = (T + R - 1) / R;
    megamoe_forward_args args[8];
    for (int r = 0; r < R; r++) {
        const int t0 = r * chunk < T ? r * chunk : T, t1 = t0 + chunk < T ? t0 + chunk : T;
        args[r] = (megamoe_forward_args){
            t1 - t0,     d->x + (size_t)t0 * H, d->ids + (size_t)t0 * K, d->w + (size_t)t0 * K,
            d->pad + t0, d->y + (size_t)t0 * H};
    }
    return megamoe_layer_forward(l, args, NULL);
}

/* A forward that must succeed; returns y on the host. */
static uint16_t *forward_ok(megamoe_layer *l, int R, const dev_io *d) {
    megamoe_status st = forward(l, R, d);
    if (st == MEGAMOE_OK) st = megamoe_layer_check(l);
    if (st) fail_msg("forward: %s", megamoe_layer_last_error(l));
    uint16_t *y = malloc((size_t)T * H * 2);
    CK(cudaMemcpy(y, d->y, (size_t)T * H * 2, cudaMemcpyDeviceToHost));
    return y;
}

/* Every element written and finite, relative L2 to the CPU's y within 1e-3 (test_gpu's bound). */
static void expect_cpu(const uint16_t *y, const uint16_t *y_cpu, const char *what) {
    double num = 0, den = 0;
    for (size_t i = 0; i < (size_t)T * H; i++) {
        const double a = tu_f32(y[i]), b = tu_f32(y_cpu[i]);
        if (!isfinite(a) || !isfinite(b)) fail_msg("%s: element %zu is %g (CPU %g)", what, i, a, b);
        num += (a - b) * (a - b), den += b * b;
    }
    const double rel = sqrt(num / den);
    printf("  %-48s rel L2 vs CPU %.2e\n", what, rel);
    if (!(rel <= 1e-3)) fail_msg("%s: relative L2 %.3e over 1e-3", what, rel);
}

/* A forward with rank `held` held back: TIMEOUT from megamoe_layer_check within the bound, the message
 * naming the rank and timeout_ms, no CUDA error; then the hold is lifted. */
static void expect_timeout(megamoe_layer *l, int R, int held, int timeout_ms, const dev_io *d) {
    assert_int_equal(mm_test_hold_rank(l, held), MEGAMOE_OK);
    CK(cudaDeviceSynchronize());
    const double t0 = now_ms();
    megamoe_status st = forward(l, R, d);
    if (st)
        fail_msg("the forward itself failed (the timeout is reported by the check): %s",
                 megamoe_layer_last_error(l));
    st = megamoe_layer_check(l);
    const double ms = now_ms() - t0;
    const char *msg = megamoe_layer_last_error(l);
    printf("  R=%d rank %d held, timeout_ms=%d: %s after %.0f ms: %s\n", R, held, timeout_ms,
           megamoe_status_string(st), ms, msg);
    if (st != MEGAMOE_ERR_TIMEOUT) fail_msg("check returned %s, not TIMEOUT", megamoe_status_string(st));
    if (ms > timeout_ms + 1000.0) fail_msg("TIMEOUT after %.0f ms: over timeout_ms + 1 s", ms);
    if (ms < 0.95 * timeout_ms) fail_msg("TIMEOUT after %.0f ms: sooner than timeout_ms=%d", ms, timeout_ms);
    char want[64];
    snprintf(want, sizeof want, "for rank %d,", held);
    if (!strstr(msg, want)) fail_msg("the message does not name the held rank (\"%s\"): %s", want, msg);
    snprintf(want, sizeof want, "timeout_ms=%d", timeout_ms);
    if (!strstr(msg, want)) fail_msg("the message does not name the timeout (\"%s\"): %s", want, msg);
    /* y is not valid after a timeout (SPEC §5): nothing is expected of it. */
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    assert_int_equal(mm_test_hold_rank(l, -1), MEGAMOE_OK);
}

static void run(int R, int timeout_ms) {
    printf("R=%d timeout_ms=%d\n", R, timeout_ms);
    megamoe_layer_config c;
    megamoe_layer_config_init(&c);
    c.name = "gpu.timeout";
    c.num_experts = E, c.top_k = K, c.hidden_size = H, c.intermediate_size = I, c.max_tokens = T_MAX;
    tu_model m;
    tu_model_random(&m, &c, 1, 1000u + (uint64_t)R * 17 + (uint64_t)timeout_ms);
    tu_inputs in;
    tu_inputs_random(&in, T, K, H, E, 2000u + (uint64_t)R * 31 + (uint64_t)timeout_ms);
    dev_io d;
    CK(cudaMalloc((void **)&d.x, (size_t)T * H * 2));
    CK(cudaMalloc((void **)&d.y, (size_t)T * H * 2));
    CK(cudaMalloc((void **)&d.ids, (size_t)T * K * 4));
    CK(cudaMalloc((void **)&d.w, (size_t)T * K * 4));
    CK(cudaMalloc((void **)&d.pad, (size_t)T));
    CK(cudaMemcpy(d.x, in.x, (size_t)T * H * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.ids, in.ids, (size_t)T * K * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.w, in.weights, (size_t)T * K * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.pad, in.padding, (size_t)T, cudaMemcpyHostToDevice));

    /* The CPU backend, one rank holding every token. */
    tu_model mc = m;
    mc.cfg.max_tokens = T;
    megamoe_group *g = make_group(MEGAMOE_BACKEND_CPU, 1);
    megamoe_layer *l = make_layer(g, &mc, timeout_ms);
    uint16_t *y_cpu = malloc((size_t)T * H * 2);
    assert_int_equal(tu_forward(g, l, &in, y_cpu), MEGAMOE_OK);
    megamoe_layer_destroy(l);
    megamoe_group_destroy(g);

    /* The CUDA backend in a group that never holds a rank. */
    g = make_group(MEGAMOE_BACKEND_CUDA, R);
    l = make_layer(g, &m, timeout_ms);
    uint16_t *y_ref = forward_ok(l, R, &d);
    expect_cpu(y_ref, y_cpu, "never held");
    megamoe_layer_destroy(l);
    megamoe_group_destroy(g);

    g = make_group(MEGAMOE_BACKEND_CUDA, R);
    const int keep = timeout_ms == 200; /* a second layer keeps the buffer across the timed-out layer's end */
    megamoe_layer *other = keep ? make_layer(g, &m, timeout_ms) : NULL;
    l = make_layer(g, &m, timeout_ms);
    const mm_buffer *timed_out_buffer = l->buffer;
    expect_timeout(l, R, R - 1, timeout_ms, &d);
    megamoe_layer_destroy(l);

    l = make_layer(g, &m, timeout_ms);
    if (keep && l->buffer != timed_out_buffer) fail_msg("the fresh layer does not reuse the group's buffer");
    uint16_t *y = forward_ok(l, R, &d);
    if (memcmp(y, y_ref, (size_t)T * H * 2) != 0)
        fail_msg("fresh layer after a timeout: y differs from a clean group");
    expect_cpu(y, y_cpu, keep ? "fresh layer, reused buffer" : "fresh layer, new buffer");
    free(y);
    if (keep) {
        expect_timeout(l, R, 0, timeout_ms, &d);
        y = forward_ok(l, R, &d);
        if (memcmp(y, y_ref, (size_t)T * H * 2) != 0)
            fail_msg("after a second timeout: y differs from a clean group");
        free(y);
        y = forward_ok(other, R, &d);
        if (memcmp(y, y_ref, (size_t)T * H * 2) != 0)
            fail_msg("the layer kept alive: y differs from a clean group");
        free(y);
        megamoe_layer_destroy(other);
    }
    megamoe_layer_destroy(l);
    megamoe_group_destroy(g);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());

    free(y_ref);
    free(y_cpu);
    cudaFree(d.x), cudaFree(d.y), cudaFree(d.ids), cudaFree(d.w), cudaFree(d.pad);
    tu_inputs_free(&in);
    tu_model_free(&m);
}

static void test_r2_200(void **state) { run(2, 200); }
static void test_r4_200(void **state) { run(4, 200); }
static void test_r2_1000(void **state) { run(2, 1000); }
static void test_r4_1000(void **state) { run(4, 1000); }

int main(void) {
    if (!megamoe_backend_available(MEGAMOE_BACKEND_CUDA)) {
        printf("SKIPPED: no usable sm_90 GPU here, or this build has no CUDA backend\n");
        return 77;
    }
    const struct CMUnitTest all[] = {
        cmocka_unit_test(test_r2_200),
        cmocka_unit_test(test_r4_200),
        cmocka_unit_test(test_r2_1000),
        cmocka_unit_test(test_r4_1000),
    };
    return _cmocka_run_group_tests("gpu_timeout", all, 4, NULL, NULL) ? 1 : 0;
}
