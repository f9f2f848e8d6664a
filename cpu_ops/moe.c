/* moepass::MoEPacked on the CPU: com.microsoft::MoEPacked's inputs and attributes (the GGUF's own gate,
 * up and down blocks [E, rows, row bytes], typed by GGML type id) with float32 activations; each
 * expert's rows in row groups of `row_group` (kernels.h).
 *
 * Per token: softmax of the router logits, the k largest (ties to the lower expert), their weights
 * (router_weights where given) renormalized over the k where normalize_routing_weights is 1; then for
 * each selected expert down(swiglu(gate . x + gate_bias, up . x + up_bias)) + down_bias, the SwiGLU
 * g' sigmoid(activation_alpha g') (u' + activation_beta) with g' = min(g, swiglu_limit) and u' u
 * clamped to +-swiglu_limit where that is given (gpt-oss), the activations of each product quantized per
 * row as llama.cpp quantizes them; the experts' outputs summed in the order of selection. Each row's
 * arithmetic is the same whatever else is in the call: a token's result does not depend on the batch.
 * Work runs per expert over chunks of weight rows, each chunk against every token routed there as one
 * tile (the weights read once for all of them). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ops.h"

#define OP "MoEPacked"
#define ROW_CHUNK 32   /* weight rows a task: whole row groups */
/* tokens computed together: bounds the scratch memory (31 MiB at Qwen3-30B-A3B's sizes). Each chunk reads
 * every expert its tokens reach, mostly all of them: from 64 to 256 the 6-layer Q4_K_M file's 128-token
 * prefill went from 426 to 497 tokens/s and its 512-token one from 416 to 515; 512 was no faster */
#define TOKEN_CHUNK 256

typedef struct {
    int64_t k, normalize, types[3];
    float alpha, beta, limit; /* the SwiGLU: gate' sigmoid(alpha gate') (up' + beta), clamped at limit */
    int clamped;
    const KernelTable *kernels;
} Moe;

/* a float attribute, `fallback` where the node has none (*present 0) */
static OrtStatus *float_attribute(const OrtKernelInfo *info, const char *name, float fallback, float *out,
                                  int *present) {
    OrtStatus *status = ort.KernelInfoGetAttribute_float(info, name, out);
    *present = !status;
    if (status) {
        ort.ReleaseStatus(status);
        *out = fallback;
    }
    return NULL;
}

static OrtStatus *int_attribute(const OrtKernelInfo *info, const char *name, int64_t fallback, int required,
                                int64_t *out) {
    OrtStatus *status = ort.KernelInfoGetAttribute_int64(info, name, out);
    if (!status)
        return NULL;
    ort.ReleaseStatus(status);
    if (required)
        return op_error(OP, "attribute %s is required", name);
    *out = fallback;
    return NULL;
}

OrtStatus *moe_create(const OrtKernelInfo *info, const KernelTable *kernels, void **kernel) {
    Moe m = {.kernels = kernels};
    OrtStatus *status;
    static const char *type_names[3] = {"gate_type", "up_type", "down_type"};
    int64_t row_group;
    if ((status = int_attribute(info, "k", 0, 1, &m.k)) ||
        (status = int_attribute(info, "normalize_routing_weights", 0, 0, &m.normalize)) ||
        (status = row_group_attribute(info, OP, &row_group)))
        return status;
    for (int i = 0; i < 3; i++) {
        if ((status = int_attribute(info, type_names[i], 0, 1, &m.types[i])))
            return status;
        if (quant_type_index(m.types[i]) < 0)
            return op_error(OP, "%s %lld: a GGML type these kernels do not take", type_names[i],
                            (long long)m.types[i]);
    }
    char activation[32] = "swiglu";
    size_t size = sizeof activation;
    status = ort.KernelInfoGetAttribute_string(info, "activation_type", activation, &size);
    if (status)
        ort.ReleaseStatus(status);
    if (strcmp(activation, "swiglu"))
        return op_error(OP, "activation_type %.31s: only swiglu is computed", activation);
    if (m.normalize != 0 && m.normalize != 1)
        return op_error(OP, "normalize_routing_weights %lld: 0 or 1", (long long)m.normalize);
    int present;
    float_attribute(info, "activation_alpha", 1.0f, &m.alpha, &present);
    float_attribute(info, "activation_beta", 0.0f, &m.beta, &present);
    float_attribute(info, "swiglu_limit", 0.0f, &m.limit, &m.clamped);
    if (m.clamped && !(m.limit > 0.0f))
        return op_error(OP, "swiglu_limit %g: a positive limit", (double)m.limit);
    if (!isfinite(m.alpha) || !isfinite(m.beta))
        return op_error(OP, "activation_alpha and activation_beta must be finite");
    Moe *copy = malloc(sizeof m);
    if (!copy)
        return op_error(OP, "out of memory");
    *copy = m;
    *kernel = copy;
    return NULL;
}

typedef struct {
    BlockMatrix gate, up, down;
    size_t tokens, hidden, ffn, experts, k;
    const Moe *op;
    const float *gate_bias, *up_bias, *down_bias; /* [E, ffn], [E, ffn], [E, hidden]; NULL: none */
    const float *x;
    /* one token chunk: its first token's input, its size */
    const float *x_chunk;
    size_t chunk_tokens, t0;
    uint8_t *x_act;      /* [chunk tokens] quantized hidden rows */
    int32_t *pair_order; /* token * k + slot, grouped by expert */
    size_t *offsets;     /* [experts + 1] into pair_order */
    const int32_t *selected;
    size_t *tasks;       /* expert * rows + first row, of the phase running */
    float *gated, *up_out, *down_out;
    uint8_t *act;        /* [chunk tokens * k] quantized SwiGLU rows */
    const KernelTable *kernels;
} Work;

/* the activation rows of the pairs routed to expert e (from `base`, `width` wide) and the outputs of
 * its rows from r0 (in `out`, `stride` a pair); their count */
static size_t expert_tile(const Work *w, size_t e, const uint8_t *base, size_t width, int act, int by_token,
                          float *out, size_t stride, size_t r0, ActRow *x, float **outs) {
    size_t n = 0;
    for (size_t p = w->offsets[e]; p < w->offsets[e + 1]; p++, n++) {
        size_t pair = (size_t)w->pair_order[p];
        x[n] = act_row_at((uint8_t *)base + (by_token ? pair / w->k : pair) * act_row_bytes(width, act), width, act);
        outs[n] = out + pair * stride + r0;
    }
    return n;
}

static void gate_up_task(void *data, size_t i) {
    Work *w = data;
    size_t e = w->tasks[i] / w->ffn, r0 = w->tasks[i] % w->ffn, n = w->ffn - r0 < ROW_CHUNK ? w->ffn - r0 : ROW_CHUNK;
    ActRow x[TOKEN_CHUNK];
    float *outs[TOKEN_CHUNK];
    size_t nx = expert_tile(w, e, w->x_act, w->hidden, w->gate.act, 1, w->gated, w->ffn, r0, x, outs);
    w->gate.dot(w->gate.data + (e * w->ffn + r0) * w->gate.row_bytes, w->gate.row_bytes, n, w->gate.blocks, x, nx,
                outs);
    for (size_t t = 0; t < nx; t++)
        outs[t] += w->up_out - w->gated;
    w->up.dot(w->up.data + (e * w->ffn + r0) * w->up.row_bytes, w->up.row_bytes, n, w->up.blocks, x, nx, outs);
}

static void swiglu_task(void *data, size_t pair) {
    Work *w = data;
    float *g = w->gated + pair * w->ffn, *u = w->up_out + pair * w->ffn;
    const size_t e = (size_t)w->selected[w->t0 * w->k + pair];
    if (w->gate_bias)
        for (size_t j = 0; j < w->ffn; j++) {
            g[j] += w->gate_bias[e * w->ffn + j];
            u[j] += w->up_bias[e * w->ffn + j];
        }
    const Moe *op = w->op;
    if (op->clamped) /* NaN stays NaN, as llama.cpp's std::min keeps it */
        for (size_t j = 0; j < w->ffn; j++) {
            g[j] = g[j] > op->limit ? op->limit : g[j];
            u[j] = u[j] > op->limit ? op->limit : u[j] < -op->limit ? -op->limit : u[j];
        }
    if (op->alpha == 1.0f && op->beta == 0.0f)
        for (size_t j = 0; j < w->ffn; j++)
            g[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    else
        for (size_t j = 0; j < w->ffn; j++)
            g[j] = g[j] / (1.0f + expf(-op->alpha * g[j])) * (u[j] + op->beta);
    ActRow a = act_row_at(w->act + pair * act_row_bytes(w->ffn, w->down.act), w->ffn, w->down.act);
    w->kernels->quantize[w->down.act](g, w->ffn, &a);
}

static void down_task(void *data, size_t i) {
    Work *w = data;
    size_t e = w->tasks[i] / w->hidden, r0 = w->tasks[i] % w->hidden;
    size_t n = w->hidden - r0 < ROW_CHUNK ? w->hidden - r0 : ROW_CHUNK;
    ActRow x[TOKEN_CHUNK];
    float *outs[TOKEN_CHUNK];
    size_t nx = expert_tile(w, e, w->act, w->ffn, w->down.act, 0, w->down_out, w->hidden, r0, x, outs);
    w->down.dot(w->down.data + (e * w->hidden + r0) * w->down.row_bytes, w->down.row_bytes, n, w->down.blocks, x,
                nx, outs);
}

static void quantize_task(void *data, size_t t) {
    Work *w = data;
    ActRow x = act_row_at(w->x_act + t * act_row_bytes(w->hidden, w->gate.act), w->hidden, w->gate.act);
    w->kernels->quantize[w->gate.act](w->x_chunk + t * w->hidden, w->hidden, &x);
}

/* tasks of one phase: (expert, first row) for every expert with tokens; their count */
static size_t row_tasks(Work *w, size_t rows) {
    size_t n = 0;
    for (size_t e = 0; e < w->experts; e++)
        if (w->offsets[e + 1] > w->offsets[e])
            for (size_t r = 0; r < rows; r += ROW_CHUNK)
                w->tasks[n++] = e * rows + r;
    return n;
}

/* softmax, top-k and the mixing weights of one token */
static void route(const float *logits, const float *given, size_t experts, size_t k, int normalize, float *probs,
                  int32_t *selected, float *weights) {
    float top = logits[0], sum = 0.0f;
    for (size_t e = 1; e < experts; e++)
        top = logits[e] > top ? logits[e] : top;
    for (size_t e = 0; e < experts; e++) {
        probs[e] = expf(logits[e] - top);
        sum += probs[e];
    }
    for (size_t e = 0; e < experts; e++)
        probs[e] /= sum;
    for (size_t s = 0; s < k; s++) {
        int32_t best = -1;
        for (size_t e = 0; e < experts; e++) {
            int taken = 0;
            for (size_t j = 0; j < s; j++)
                taken |= selected[j] == (int32_t)e;
            if (!taken && (best < 0 || probs[e] > probs[best]))
                best = (int32_t)e;
        }
        selected[s] = best;
        weights[s] = given ? given[best] : probs[best];
    }
    if (normalize) {
        float total = 0.0f;
        for (size_t s = 0; s < k; s++)
            total += weights[s];
        for (size_t s = 0; s < k; s++)
            weights[s] /= total;
    }
}

static OrtStatus *check_inputs(const Moe *m, const Tensor in[9], Work *w) {
    const Tensor *x = &in[0], *logits = &in[1], *given = &in[5];
    if (x->type != ORT_ELEMENT_FLOAT || x->rank < 2 || logits->type != ORT_ELEMENT_FLOAT || logits->rank < 2)
        return op_error(OP, "input and router logits must be float32 tensors [tokens, width]");
    w->hidden = (size_t)x->dims[x->rank - 1];
    w->experts = (size_t)logits->dims[logits->rank - 1];
    w->tokens = 1;
    size_t routed = 1;
    for (size_t i = 0; i + 1 < x->rank; i++)
        w->tokens *= (size_t)x->dims[i];
    for (size_t i = 0; i + 1 < logits->rank; i++)
        routed *= (size_t)logits->dims[i];
    if (routed != w->tokens || w->experts == 0)
        return op_error(OP, "router logits hold %zu tokens of %zu experts for %zu tokens", routed, w->experts,
                        w->tokens);
    if (m->k < 1 || (size_t)m->k > w->experts)
        return op_error(OP, "k %lld: 1 to the %zu experts", (long long)m->k, w->experts);
    w->k = (size_t)m->k;
    for (int i = 2; i < 5; i++)
        if (in[i].rank != 3 || (size_t)in[i].dims[0] != w->experts)
            return op_error(OP, "input %d: expected blocks [%zu experts, rows, row bytes]", i, w->experts);
    OrtStatus *status;
    if ((status = block_matrix(OP, "gate", &in[2], m->types[0], w->hidden, m->kernels, &w->gate)) ||
        (status = block_matrix(OP, "up", &in[3], m->types[1], w->hidden, m->kernels, &w->up)))
        return status;
    w->ffn = w->gate.rows;
    if (w->up.rows != w->ffn)
        return op_error(OP, "gate has %zu rows, up %zu", w->ffn, w->up.rows);
    if ((status = block_matrix(OP, "down", &in[4], m->types[2], w->ffn, m->kernels, &w->down)))
        return status;
    if (w->down.rows != w->hidden)
        return op_error(OP, "down has %zu rows for a width of %zu", w->down.rows, w->hidden);
    if (w->gate.act != w->up.act)
        return op_error(OP, "gate and up types take different activations");
    if (given->value) {
        size_t n = 1;
        for (size_t i = 0; i < given->rank; i++)
            n *= (size_t)given->dims[i];
        if (given->type != ORT_ELEMENT_FLOAT || n != w->tokens * w->experts)
            return op_error(OP, "router_weights must be float32 [tokens, experts]");
    }
    static const char *bias_names[3] = {"gate_bias", "up_bias", "down_bias"};
    const float **biases[3] = {&w->gate_bias, &w->up_bias, &w->down_bias};
    for (int i = 0; i < 3; i++) {
        const Tensor *b = &in[6 + i];
        size_t rows = i < 2 ? w->ffn : w->hidden;
        if (!b->value)
            continue;
        if (b->type != ORT_ELEMENT_FLOAT || b->rank != 2 || (size_t)b->dims[0] != w->experts ||
            (size_t)b->dims[1] != rows)
            return op_error(OP, "%s must be float32 [%zu experts, %zu]", bias_names[i], w->experts, rows);
        *biases[i] = b->data;
    }
    if (!w->gate_bias != !w->up_bias)
        return op_error(OP, "gate_bias and up_bias come together");
    return NULL;
}

static void run_chunk(OrtKernelContext *context, Work *w, size_t t0, float *out, const float *weights) {
    size_t nt = w->chunk_tokens, k = w->k;
    /* pairs (token, slot) grouped by expert, in token order within an expert */
    memset(w->offsets, 0, (w->experts + 1) * sizeof *w->offsets);
    for (size_t p = 0; p < nt * k; p++)
        w->offsets[w->selected[(t0 * k) + p] + 1]++;
    for (size_t e = 0; e < w->experts; e++)
        w->offsets[e + 1] += w->offsets[e];
    size_t *fill = w->tasks; /* borrowed as cursors */
    memcpy(fill, w->offsets, w->experts * sizeof *fill);
    for (size_t p = 0; p < nt * k; p++)
        w->pair_order[fill[w->selected[t0 * k + p]]++] = (int32_t)p;
    w->x_chunk = w->x + t0 * w->hidden;
    w->t0 = t0;
    parallel_for(context, quantize_task, nt, w);
    parallel_for(context, gate_up_task, row_tasks(w, w->ffn), w);
    parallel_for(context, swiglu_task, nt * k, w);
    parallel_for(context, down_task, row_tasks(w, w->hidden), w);
    for (size_t t = 0; t < nt; t++) {
        float *o = out + (t0 + t) * w->hidden, *d = w->down_out + t * k * w->hidden;
        const float *wt = weights + (t0 + t) * k;
        if (w->down_bias)
            for (size_t s = 0; s < k; s++) {
                const float *b = w->down_bias + (size_t)w->selected[(t0 + t) * k + s] * w->hidden;
                for (size_t j = 0; j < w->hidden; j++)
                    d[s * w->hidden + j] += b[j];
            }
        for (size_t j = 0; j < w->hidden; j++)
            o[j] = wt[0] * d[j];
        for (size_t s = 1; s < k; s++)
            for (size_t j = 0; j < w->hidden; j++)
                o[j] += wt[s] * d[s * w->hidden + j];
    }
}

OrtStatus *moe_compute(void *kernel, OrtKernelContext *context) {
    const Moe *m = kernel;
    Tensor in[9];
    OrtStatus *status;
    for (size_t i = 0; i < 9; i++)
        if ((status = read_input(context, i, &in[i], OP)))
            return status;
    Work w = {.kernels = m->kernels, .op = m};
    if ((status = check_inputs(m, in, &w)))
        return status;
    float *out;
    if ((status = make_output(context, 0, in[0].dims, in[0].rank, &out)) || w.tokens == 0)
        return status;
    w.x = in[0].data;
    size_t k = w.k, chunk = w.tokens < TOKEN_CHUNK ? w.tokens : TOKEN_CHUNK;
    size_t rows = w.ffn > w.hidden ? w.ffn : w.hidden, tasks = w.experts * ((rows + ROW_CHUNK - 1) / ROW_CHUNK);
    int32_t *selected = malloc(w.tokens * k * sizeof *selected);
    float *weights = malloc(w.tokens * k * sizeof *weights), *probs = malloc(w.experts * sizeof *probs);
    w.x_act = malloc(chunk * act_row_bytes(w.hidden, w.gate.act));
    w.pair_order = malloc(chunk * k * sizeof *w.pair_order);
    w.offsets = malloc((w.experts + 1) * sizeof *w.offsets);
    w.tasks = malloc((tasks > w.experts ? tasks : w.experts) * sizeof *w.tasks);
    w.gated = malloc(chunk * k * w.ffn * sizeof(float));
    w.up_out = malloc(chunk * k * w.ffn * sizeof(float));
    w.down_out = malloc(chunk * k * w.hidden * sizeof(float));
    w.act = malloc(chunk * k * act_row_bytes(w.ffn, w.down.act));
    if (!selected || !weights || !probs || !w.x_act || !w.pair_order || !w.offsets || !w.tasks || !w.gated ||
        !w.up_out || !w.down_out || !w.act) {
        status = op_error(OP, "out of memory for %zu tokens", w.tokens);
    } else {
        const float *logits = in[1].data, *given = in[5].value ? in[5].data : NULL;
        for (size_t t = 0; t < w.tokens; t++)
            route(logits + t * w.experts, given ? given + t * w.experts : NULL, w.experts, k, (int)m->normalize,
                  probs, selected + t * k, weights + t * k);
        w.selected = selected;
        for (size_t t0 = 0; t0 < w.tokens; t0 += chunk) {
            w.chunk_tokens = w.tokens - t0 < chunk ? w.tokens - t0 : chunk;
            run_chunk(context, &w, t0, out, weights);
        }
    }
    free(selected), free(weights), free(probs), free(w.x_act), free(w.pair_order), free(w.offsets);
    free(w.tasks), free(w.gated), free(w.up_out), free(w.down_out), free(w.act);
    return status;
}
