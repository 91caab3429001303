/* rollout_gateway._native: the decoder's byte-level parsers in C (the "native data plane").
 *
 * Each parser is the compiled form of a pure-Python function that stays the reference
 * (rollout_gateway/native.py selects between them; tests/unit/test_native_parity.py and
 * tests/security/test_decode_properties.py prove them equal, hostile input included):
 *
 *   top_rows(seg)                -> (logprobs: bytearray of float64, ids: bytearray of int64,
 *                                    t, k) or None
 *       decode_toplogprobs.parse_top_segment's parser: a canonical top-logprobs JSON value
 *       ([[[logprob, id, null], ...k], ...t]) straight into columns, one pass, no Python
 *       object per entry. None means "not canonical" exactly where the Python parser says so.
 *
 *   experts(buf, start, end, num_experts) -> (bytearray of ids, end) or (None, end)
 *       decode_experts' routed_experts decoder: base64 of little-endian int32 in
 *       buf[start:end] (end < 0: up to the next '"', which is then returned), range-checked
 *       against num_experts and narrowed to uint8 (num_experts <= 256) or int32 in the same
 *       pass. (None, end) means "not decoded here": invalid base64, an id out of range,
 *       padding with stray bits... the caller then runs the Python decoder on the same text,
 *       which gives the answer or the exact error. end is -1 when no closing quote exists.
 *
 *   land(n)                      -> (bytes, writer)
 *       a new bytes object of n bytes, not initialised, and an object exporting its storage
 *       as a writable buffer (keeping the bytes alive): rawconn.RawConnection.land has the
 *       socket receive a large body straight into it, so the body is never copied out of
 *       a receive buffer. The bytes must not be used before it is filled, and the writer
 *       not after (RawConnection releases its view before it returns the bytes).
 *
 * Every read is bounds-checked against the buffer's length (no reliance on a terminating
 * NUL); output sizes are computed from the input before writing. Nothing here raises on
 * malformed input: it declines (None) and the Python path decides.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <float.h>

/* ------------------------------------------------------------------ numbers */

static int is_ws(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

enum { NUM_BAD = 0, NUM_OK = 1, NUM_NULL = 2 };

static const double P10[23] = {1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11,
                               1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21,
                               1e22};

/* The correctly rounded double of a validated JSON number, when it can be had cheaply and
 * provably: returns 0 to leave it to the exact (slow) conversion.
 * (1) Clinger: mantissa <= 2^53 and |exponent| <= 22: one IEEE operation on exact
 *     operands, so one rounding: correct.
 * (2) x87 extended precision (64-bit significand): mantissa < 2^64 and |exponent| <= 27
 *     are exact there, one operation rounds to within half an extended ulp; the result is
 *     used only when no halfway point between two doubles lies within 4 extended ulps
 *     (so rounding it to double again gives the correctly rounded double). */
#if defined(__x86_64__) && LDBL_MANT_DIG == 64
static long double P10L[28];  /* exact powers of ten (5^27 < 2^64) */
#endif

static int fast_double(const char *s, Py_ssize_t n, double *out)
{
    Py_ssize_t p = 0;
    int neg = 0;
    if (s[p] == '-') { neg = 1; p++; }
    uint64_t mant = 0;
    int digits = 0;          /* significant digits taken into mant */
    long exp10 = 0;
    for (; p < n && s[p] >= '0' && s[p] <= '9'; p++) {
        if (mant == 0 && s[p] == '0') continue;
        if (digits == 19) return 0;
        mant = mant * 10 + (uint64_t)(s[p] - '0');
        digits++;
    }
    if (p < n && s[p] == '.') {
        for (p++; p < n && s[p] >= '0' && s[p] <= '9'; p++) {
            exp10--;
            if (mant == 0 && s[p] == '0') continue;
            if (digits == 19) return 0;
            mant = mant * 10 + (uint64_t)(s[p] - '0');
            digits++;
        }
    }
    if (p < n && (s[p] == 'e' || s[p] == 'E')) {
        int eneg = 0;
        long e = 0;
        p++;
        if (p < n && (s[p] == '+' || s[p] == '-')) { eneg = s[p] == '-'; p++; }
        for (; p < n && s[p] >= '0' && s[p] <= '9'; p++) {
            if (e > 100000) return 0;
            e = e * 10 + (s[p] - '0');
        }
        exp10 += eneg ? -e : e;
    }
    if (mant == 0) { *out = neg ? -0.0 : 0.0; return 1; }
    double v;
    if (mant <= (1ULL << 53) && exp10 >= -22 && exp10 <= 22) {
        v = exp10 < 0 ? (double)mant / P10[-exp10] : (double)mant * P10[exp10];
    } else {
#if defined(__x86_64__) && LDBL_MANT_DIG == 64
        if (exp10 < -27 || exp10 > 27) return 0;
        long double p10 = P10L[exp10 < 0 ? -exp10 : exp10];
        long double r = exp10 < 0 ? (long double)mant / p10 : (long double)mant * p10;
        v = (double)r;
        if (!isfinite(v) || v == 0.0 || fabs(v) < 2.2250738585072014e-308) return 0;
        long double lo = ((long double)v + (long double)nextafter(v, -INFINITY)) / 2;
        long double hi = ((long double)v + (long double)nextafter(v, INFINITY)) / 2;
        long double eps = fabsl(r) * 0x1p-61L;
        if (!(r - lo > eps && hi - r > eps)) return 0;
#else
        return 0;
#endif
    }
    *out = neg ? -v : v;
    return 1;
}

/* One JSON scalar at s[*i..n) -> double, as orjson.loads + float() would give it.
 * Integers in [-2^63, 2^64) are exact ints (so "-0" is +0.0, and float() rounds them);
 * other integers and all non-integers parse as correctly rounded doubles; a double that
 * overflows is an orjson error (NUM_BAD). "null" -> NUM_NULL. Anything else -> NUM_BAD. */
static int parse_scalar(const char *s, Py_ssize_t n, Py_ssize_t *i, double *out)
{
    Py_ssize_t p = *i;
    if (p < n && s[p] == 'n') {
        if (n - p >= 4 && memcmp(s + p, "null", 4) == 0) {
            *i = p + 4;
            return NUM_NULL;
        }
        return NUM_BAD;
    }
    Py_ssize_t start = p;
    int neg = 0, is_float = 0;
    if (p < n && s[p] == '-') { neg = 1; p++; }
    if (p >= n) return NUM_BAD;
    Py_ssize_t dstart = p;
    if (s[p] == '0') {
        p++;
    } else if (s[p] >= '1' && s[p] <= '9') {
        while (p < n && s[p] >= '0' && s[p] <= '9') p++;
    } else {
        return NUM_BAD;
    }
    Py_ssize_t dend = p;
    if (p < n && s[p] == '.') {
        is_float = 1;
        p++;
        if (p >= n || s[p] < '0' || s[p] > '9') return NUM_BAD;
        while (p < n && s[p] >= '0' && s[p] <= '9') p++;
    }
    if (p < n && (s[p] == 'e' || s[p] == 'E')) {
        is_float = 1;
        p++;
        if (p < n && (s[p] == '+' || s[p] == '-')) p++;
        if (p >= n || s[p] < '0' || s[p] > '9') return NUM_BAD;
        while (p < n && s[p] >= '0' && s[p] <= '9') p++;
    }
    *i = p;
    if (!is_float && dend - dstart <= 20) {
        /* exact integer when it fits orjson's int range */
        uint64_t v = 0;
        int overflow = 0;
        for (Py_ssize_t q = dstart; q < dend; q++) {
            unsigned d = (unsigned)(s[q] - '0');
            if (v > (UINT64_MAX - d) / 10) { overflow = 1; break; }
            v = v * 10 + d;
        }
        if (!overflow) {
            if (!neg) { *out = (double)v; return NUM_OK; }
            if (v <= (uint64_t)INT64_MAX + 1) {
                *out = v == (uint64_t)INT64_MAX + 1 ? -9223372036854775808.0 : -(double)(int64_t)v;
                if (v == 0) *out = 0.0;  /* int 0: float(0) is +0.0 */
                return NUM_OK;
            }
        }
    }
    if (fast_double(s + start, p - start, out)) return NUM_OK;
    /* a correctly rounded double of the validated text (Python's own dtoa): copy it
     * NUL-terminated */
    Py_ssize_t len = p - start;
    char small[64];
    char *tmp = small;
    if (len >= (Py_ssize_t)sizeof(small)) {
        tmp = PyMem_Malloc((size_t)len + 1);
        if (tmp == NULL) return NUM_BAD;
    }
    memcpy(tmp, s + start, (size_t)len);
    tmp[len] = '\0';
    char *end = NULL;
    double v = PyOS_string_to_double(tmp, &end, NULL);
    int ok = end == tmp + len && !(v == -1.0 && PyErr_Occurred());
    if (tmp != small) PyMem_Free(tmp);
    if (!ok) { PyErr_Clear(); return NUM_BAD; }
    if (isinf(v)) return NUM_BAD;  /* orjson: "number is infinity when parsed as double" */
    *out = v;
    return NUM_OK;
}

static void skip_ws(const char *s, Py_ssize_t n, Py_ssize_t *i)
{
    while (*i < n && is_ws((unsigned char)s[*i])) (*i)++;
}

/* ------------------------------------------------------------------ top_rows */

/* Expect the character c after optional whitespace. */
static int expect(const char *s, Py_ssize_t n, Py_ssize_t *i, char c)
{
    skip_ws(s, n, i);
    if (*i < n && s[*i] == c) { (*i)++; return 1; }
    return 0;
}

/* The canonical top-logprobs value s[0..n) -> (lps, ids, t, k), or None; NULL on error. */
static PyObject *
top_span(const char *s, Py_ssize_t n)
{
    PyObject *res = NULL, *lps_obj = NULL, *ids_obj = NULL;

    /* the Python parser's gates, in its order: length, [[[ ... ]]], no '"' */
    if (n < 10 || memcmp(s, "[[[", 3) != 0 || memcmp(s + n - 3, "]]]", 3) != 0) goto decline;
    if (memchr(s, '"', (size_t)n) != NULL) goto decline;
    /* k: '[' before the first "]]", minus the outer two (as the Python parser counts) */
    Py_ssize_t first = -1;
    for (Py_ssize_t q = 0; q + 1 < n; q++) {
        if (s[q] == ']' && s[q + 1] == ']') { first = q; break; }
    }
    if (first < 0) goto decline;
    Py_ssize_t k = -2;
    for (Py_ssize_t q = 0; q < first; q++) k += s[q] == '[';
    if (k < 1) goto decline;
    /* t from the structural characters: the skeleton is 1 + t*(row+1) - 1 + 1 long */
    Py_ssize_t nstruct = 0;
    for (Py_ssize_t q = 0; q < n; q++) nstruct += s[q] == '[' || s[q] == ']' || s[q] == ',';
    Py_ssize_t row = 4 * k + (k - 1) + 2;
    if ((nstruct - 1) % (row + 1) != 0) goto decline;
    Py_ssize_t t = (nstruct - 1) / (row + 1);
    if (t < 1) goto decline;
    /* t*k <= n/4, so the sizes below cannot overflow */
    lps_obj = PyByteArray_FromStringAndSize(NULL, t * k * (Py_ssize_t)sizeof(double));
    ids_obj = PyByteArray_FromStringAndSize(NULL, t * k * (Py_ssize_t)sizeof(int64_t));
    if (lps_obj == NULL || ids_obj == NULL) goto error;
    double *lps = (double *)PyByteArray_AS_STRING(lps_obj);
    int64_t *ids = (int64_t *)PyByteArray_AS_STRING(ids_obj);

    /* Walk the exact canonical structure; whitespace may sit between any two tokens.
     * Tokens other than [ ] , and scalars make the skeleton or the flat parse fail in the
     * Python parser as well; true/false are rejected there too (any 't' or 'f'). */
    Py_ssize_t i = 0, e = 0;
    if (!expect(s, n, &i, '[')) goto decline;
    for (Py_ssize_t r = 0; r < t; r++) {
        if (r && !expect(s, n, &i, ',')) goto decline;
        if (!expect(s, n, &i, '[')) goto decline;
        for (Py_ssize_t c = 0; c < k; c++, e++) {
            double lp, id, text;
            if (c && !expect(s, n, &i, ',')) goto decline;
            if (!expect(s, n, &i, '[')) goto decline;
            skip_ws(s, n, &i);
            int a = parse_scalar(s, n, &i, &lp);
            if (a == NUM_BAD || !expect(s, n, &i, ',')) goto decline;
            skip_ws(s, n, &i);
            int b = parse_scalar(s, n, &i, &id);
            if (b != NUM_OK || !expect(s, n, &i, ',')) goto decline;
            skip_ws(s, n, &i);
            if (parse_scalar(s, n, &i, &text) != NUM_NULL) goto decline;
            if (!expect(s, n, &i, ']')) goto decline;
            /* ids: integral, in [0, 2^31) (a null id is NaN there: declined) */
            if (!(id >= 0.0 && id < 2147483648.0 && id == floor(id))) goto decline;
            lps[e] = a == NUM_NULL ? Py_NAN : lp;
            ids[e] = (int64_t)id;
        }
        if (!expect(s, n, &i, ']')) goto decline;
    }
    if (!expect(s, n, &i, ']')) goto decline;
    skip_ws(s, n, &i);
    if (i != n) goto decline;
    res = Py_BuildValue("(OOnn)", lps_obj, ids_obj, t, k);
    goto done;
decline:
    res = Py_NewRef(Py_None);
    goto done;
error:
    res = NULL;
done:
    Py_XDECREF(lps_obj);
    Py_XDECREF(ids_obj);
    return res;
}

static PyObject *
top_rows(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *res = top_span(view.buf, view.len);
    PyBuffer_Release(&view);
    return res;
}

/* ------------------------------------------------------------------ cut_columns */

/* Skip a JSON string starting at s[*i] == '"': 1 and *i after its closing quote, or 0. */
static int skip_string(const char *s, Py_ssize_t n, Py_ssize_t *i)
{
    Py_ssize_t p = *i + 1;
    for (;;) {
        const char *q = memchr(s + p, '"', (size_t)(n - p));
        if (q == NULL) return 0;
        Py_ssize_t e = q - s, bs = 0;
        while (e - 1 - bs >= p && s[e - 1 - bs] == '\\') bs++;
        p = e + 1;
        if (bs % 2 == 0) { *i = p; return 1; }
    }
}

/* Skip any JSON value at s[*i] (after whitespace) without recursion: strings escape-aware,
 * containers by depth; scalars up to the next delimiter. Validity is orjson's to judge:
 * this only needs to find where the value ends. 0 when the text ends first. */
static int skip_value(const char *s, Py_ssize_t n, Py_ssize_t *i)
{
    skip_ws(s, n, i);
    if (*i >= n) return 0;
    Py_ssize_t depth = 0;
    do {
        if (*i >= n) return 0;
        char c = s[*i];
        if (c == '"') {
            if (!skip_string(s, n, i)) return 0;
        } else if (c == '[' || c == '{') {
            depth++;
            (*i)++;
        } else if (c == ']' || c == '}') {
            if (depth == 0) return 0;
            depth--;
            (*i)++;
        } else if (depth == 0) {  /* a scalar */
            while (*i < n && !is_ws((unsigned char)s[*i]) && s[*i] != ',' && s[*i] != ']' &&
                   s[*i] != '}')
                (*i)++;
        } else {
            (*i)++;
        }
    } while (depth > 0);
    return 1;
}

/* A key string at s[*i] == '"' without escapes: its content span, *i past the ':'. */
static int read_key(const char *s, Py_ssize_t n, Py_ssize_t *i, Py_ssize_t *ks, Py_ssize_t *kl)
{
    if (*i >= n || s[*i] != '"') return 0;
    Py_ssize_t a = *i + 1;
    if (!skip_string(s, n, i)) return 0;
    *ks = a;
    *kl = *i - 1 - a;
    if (memchr(s + a, '\\', (size_t)*kl) != NULL) *kl = -1;  /* escaped: not one of ours */
    return expect(s, n, i, ':');
}

static int key_is(const char *s, Py_ssize_t ks, Py_ssize_t kl, const char *name)
{
    return kl == (Py_ssize_t)strlen(name) && memcmp(s + ks, name, (size_t)kl) == 0;
}

/* Canonical output_ids at s[a..): '[' digits (',' digits)* ']' -- no whitespace, no sign,
 * values in [0, 2^31): int32 ids; *end after ']'. NULL (no error) when not canonical. */
static PyObject *parse_ids(const char *s, Py_ssize_t n, Py_ssize_t a, Py_ssize_t *end)
{
    if (a >= n || s[a] != '[') return Py_NewRef(Py_None);
    const char *q = memchr(s + a, ']', (size_t)(n - a));
    if (q == NULL) return Py_NewRef(Py_None);
    Py_ssize_t stop = q - s, count = 0;
    if (stop > a + 1) {
        count = 1;
        for (Py_ssize_t p = a + 1; p < stop; p++) count += s[p] == ',';
    }
    PyObject *out = PyByteArray_FromStringAndSize(NULL, count * 4);
    if (out == NULL) return NULL;
    int32_t *dst = (int32_t *)PyByteArray_AS_STRING(out);
    Py_ssize_t p = a + 1;
    for (Py_ssize_t j = 0; j < count; j++) {
        if (j) {
            if (s[p] != ',') goto bad;
            p++;
        }
        Py_ssize_t d = p;
        uint64_t v = 0;
        while (p < stop && s[p] >= '0' && s[p] <= '9' && p - d < 11)
            v = v * 10 + (uint64_t)(s[p++] - '0');
        if (p == d || (s[d] == '0' && p - d > 1) || v > 0x7FFFFFFF) goto bad;
        dst[j] = (int32_t)v;
    }
    if (p != stop) goto bad;
    *end = stop + 1;
    return out;
bad:
    Py_DECREF(out);
    return Py_NewRef(Py_None);
}

/* Canonical output_token_logprobs at s[a..): '[' ('[' float|null ',' digits ',null]')
 * joined by ',' ']' with no whitespace; floats must be written as floats ('.' or 'e'), so
 * the rows are exactly what LogprobRows.to_rows() gives back. (lps f64, ids i64) or None. */
static PyObject *parse_token_rows(const char *s, Py_ssize_t n, Py_ssize_t a, Py_ssize_t *end)
{
    if (n - a < 2 || s[a] != '[') return Py_NewRef(Py_None);
    Py_ssize_t count = 0;
    if (s[a + 1] == ']') {
        count = 0;
    } else {
        /* one ']' per row up to the closing "]]" */
        const char *stop = NULL;
        for (Py_ssize_t p = a; p + 1 < n; p++) {
            if (s[p] == ']' && s[p + 1] == ']') { stop = s + p; break; }
        }
        if (stop == NULL) return Py_NewRef(Py_None);
        for (const char *r = s + a; r <= stop; r++) count += *r == ']';
    }
    PyObject *lps_obj = PyByteArray_FromStringAndSize(NULL, count * 8);
    PyObject *ids_obj = PyByteArray_FromStringAndSize(NULL, count * 8);
    PyObject *res = NULL;
    if (lps_obj == NULL || ids_obj == NULL) goto done;
    double *lps = (double *)PyByteArray_AS_STRING(lps_obj);
    int64_t *ids = (int64_t *)PyByteArray_AS_STRING(ids_obj);
    Py_ssize_t p = a + 1;
    for (Py_ssize_t j = 0; j < count; j++) {
        if (j) {
            if (p >= n || s[p] != ',') goto decline;
            p++;
        }
        if (p >= n || s[p] != '[') goto decline;
        p++;
        Py_ssize_t num = p;
        double lp, id, text;
        int kind = parse_scalar(s, n, &p, &lp);
        if (kind == NUM_BAD) goto decline;
        if (kind == NUM_OK) {  /* written as a float: a '.' or an exponent */
            Py_ssize_t q = num;
            while (q < p && s[q] != '.' && s[q] != 'e' && s[q] != 'E') q++;
            if (q == p) goto decline;
        }
        if (p >= n || s[p] != ',') goto decline;
        p++;
        Py_ssize_t d = p;
        if (parse_scalar(s, n, &p, &id) != NUM_OK) goto decline;
        for (Py_ssize_t q = d; q < p; q++)
            if (s[q] < '0' || s[q] > '9') goto decline;
        if (!(id < 2147483648.0)) goto decline;
        if (p >= n || s[p] != ',') goto decline;
        p++;
        if (parse_scalar(s, n, &p, &text) != NUM_NULL) goto decline;
        if (p >= n || s[p] != ']') goto decline;
        p++;
        lps[j] = kind == NUM_NULL ? Py_NAN : lp;
        ids[j] = (int64_t)id;
    }
    if (p >= n || s[p] != ']') goto decline;
    *end = p + 1;
    res = Py_BuildValue("(OO)", lps_obj, ids_obj);
    goto done;
decline:
    res = Py_NewRef(Py_None);
done:
    Py_XDECREF(lps_obj);
    Py_XDECREF(ids_obj);
    return res;
}

/* cut_columns(body) -> (ids, rows, top) where ids is (start, end, int32 bytes) for the
 * answer object's "output_ids", rows (start, end, float64 bytes, int64 bytes) for its
 * meta_info's "output_token_logprobs" and top (start, end, float64 bytes, int64 bytes, t, k)
 * for its meta_info's "output_top_logprobs" (as top_rows parses it), each None when absent
 * or not canonical; None when
 * the body is not one JSON object. Keys are matched by structure (their exact place in
 * the answer), never by a text search, so nothing else is ever cut. */
static PyObject *
cut_columns(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    const char *s = view.buf;
    Py_ssize_t n = view.len, i = 0;
    PyObject *ids = NULL, *rows = NULL, *top = NULL, *res = NULL;
    Py_ssize_t ids_a = 0, ids_b = 0, rows_a = 0, rows_b = 0, top_a = 0, top_b = 0;
    if (!expect(s, n, &i, '{')) goto none;
    int in_meta = 0, meta_done = 0;
    for (;;) {
        /* one key: value member of the answer (in_meta 0) or of its meta_info (1) */
        skip_ws(s, n, &i);
        if (i < n && s[i] == '}') {
            if (!in_meta) break;
            in_meta = 0;
            meta_done = 1;
            i++;
            goto next;
        }
        Py_ssize_t ks, kl;
        if (!read_key(s, n, &i, &ks, &kl)) goto none;
        skip_ws(s, n, &i);
        if (!in_meta && ids == NULL && key_is(s, ks, kl, "output_ids")) {
            Py_ssize_t e = 0;
            PyObject *got = parse_ids(s, n, i, &e);
            if (got == NULL) goto error;
            if (got != Py_None) { ids = got; ids_a = i; ids_b = e; i = e; goto next; }
            Py_DECREF(got);
        } else if (!in_meta && !meta_done && key_is(s, ks, kl, "meta_info") && i < n &&
                   s[i] == '{') {
            in_meta = 1;
            i++;
            skip_ws(s, n, &i);
            if (i < n && s[i] == '}') { in_meta = 0; meta_done = 1; i++; goto next; }
            continue;
        } else if (in_meta && rows == NULL && key_is(s, ks, kl, "output_token_logprobs")) {
            Py_ssize_t e = 0;
            PyObject *got = parse_token_rows(s, n, i, &e);
            if (got == NULL) goto error;
            if (got != Py_None) { rows = got; rows_a = i; rows_b = e; i = e; goto next; }
            Py_DECREF(got);
        } else if (in_meta && top == NULL && key_is(s, ks, kl, "output_top_logprobs") &&
                   i < n && s[i] == '[') {
            Py_ssize_t e = i;
            if (!skip_value(s, n, &e)) goto none;
            PyObject *got = top_span(s + i, e - i);
            if (got == NULL) goto error;
            if (got != Py_None) { top = got; top_a = i; top_b = e; i = e; goto next; }
            Py_DECREF(got);
        }
        if (!skip_value(s, n, &i)) goto none;
    next:
        if (ids != NULL && meta_done) break;  /* both places seen: the rest is orjson's */
        skip_ws(s, n, &i);
        if (i < n && s[i] == ',') { i++; continue; }
        if (i < n && s[i] == '}') continue;
        goto none;
    }
    if (ids == NULL && rows == NULL && top == NULL) goto none;
    {
        PyObject *a = ids ? Py_BuildValue("(nnO)", ids_a, ids_b, ids) : Py_NewRef(Py_None);
        PyObject *b = rows ? Py_BuildValue("(nnOO)", rows_a, rows_b, PyTuple_GET_ITEM(rows, 0),
                                           PyTuple_GET_ITEM(rows, 1)) : Py_NewRef(Py_None);
        PyObject *c = top ? Py_BuildValue("(nnOOOO)", top_a, top_b, PyTuple_GET_ITEM(top, 0),
                                          PyTuple_GET_ITEM(top, 1), PyTuple_GET_ITEM(top, 2),
                                          PyTuple_GET_ITEM(top, 3)) : Py_NewRef(Py_None);
        if (a == NULL || b == NULL || c == NULL) {
            Py_XDECREF(a);
            Py_XDECREF(b);
            Py_XDECREF(c);
            goto error;
        }
        res = PyTuple_Pack(3, a, b, c);
        Py_DECREF(a);
        Py_DECREF(b);
        Py_DECREF(c);
    }
    goto done;
none:
    /* a structural surprise after a cut is found is still fine to report as "no cut" */
    res = Py_NewRef(Py_None);
    goto done;
error:
    res = NULL;
done:
    Py_XDECREF(ids);
    Py_XDECREF(rows);
    Py_XDECREF(top);
    PyBuffer_Release(&view);
    return res;
}

/* ------------------------------------------------------------------ experts */

static unsigned char B64[256];  /* 6-bit value, or 0xFF: not in the alphabet */

static void init_b64(void)
{
    static const char *alpha =
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    memset(B64, 0xFF, sizeof(B64));
    for (int j = 0; j < 64; j++) B64[(unsigned char)alpha[j]] = (unsigned char)j;
}

/* Decode 4 characters to 3 bytes; 0 on a character outside the alphabet. */
static int quad(const unsigned char *c, unsigned char out[3])
{
    unsigned a = B64[c[0]], b = B64[c[1]], d = B64[c[2]], e = B64[c[3]];
    if ((a | b | d | e) & 0x80) return 0;
    out[0] = (unsigned char)(a << 2 | b >> 4);
    out[1] = (unsigned char)((b & 15) << 4 | d >> 2);
    out[2] = (unsigned char)((d & 3) << 6 | e);
    return 1;
}

/* Decode the base64 text c[0..len) of little-endian int32 into dst (count ids) as uint8
 * (wide == 0) or int32, every id < limit. Returns 1 on success, 0 to decline. */
static int decode_ids(const unsigned char *c, Py_ssize_t len, Py_ssize_t count,
                      unsigned char *dst, int wide, uint32_t limit)
{
    Py_ssize_t done = 0;  /* ids written */
    Py_ssize_t pos = 0;
    if (!wide && limit <= 256 && !PY_BIG_ENDIAN) {
        /* 16 characters = three int32 below 256: ten characters are 'A' and three
         * character pairs hold the low bytes (see decode_experts' numpy fast path) */
        /* characters 2,3,4,7 (first word) and 8,9,12,13,14,15 (second) must be 'A' */
        const uint64_t mask0 = 0xFFULL << 16 | 0xFFULL << 24 | 0xFFULL << 32 | 0xFFULL << 56;
        const uint64_t mask1 = 0xFFULL | 0xFFULL << 8 | 0xFFULL << 32 | 0xFFULL << 40 |
                               0xFFULL << 48 | 0xFFULL << 56;
        const uint64_t a8 = 0x4141414141414141ULL;
        /* chunks of blocks, checks folded into one flag per chunk (no branch per block) */
        while (len - pos >= 16 && count - done >= 3) {
            Py_ssize_t blocks = (len - pos) / 16;
            if (blocks > (count - done) / 3) blocks = (count - done) / 3;
            if (blocks > 4096) blocks = 4096;
            uint64_t bad = 0;
            unsigned mx = 0;
            const unsigned char *b = c + pos;
            unsigned char *o = dst + done;
            for (Py_ssize_t j = 0; j < blocks; j++, b += 16, o += 3) {
                uint64_t w0, w1;
                memcpy(&w0, b, 8);  /* little-endian words (the fast path is off on big-endian) */
                memcpy(&w1, b + 8, 8);
                unsigned v0 = B64[b[0]], v1 = B64[b[1]], v5 = B64[b[5]], v6 = B64[b[6]];
                unsigned v10 = B64[b[10]], v11 = B64[b[11]];
                /* ten characters 'A'; all six in the alphabet; the bits of the zero high
                 * bytes zero */
                bad |= ((w0 & mask0) ^ (a8 & mask0)) | ((w1 & mask1) ^ (a8 & mask1));
                bad |= ((v0 | v1 | v5 | v6 | v10 | v11) & 0x80) | (v1 & 15) | (v5 & 0x30) |
                       (v6 & 3) | (v10 & 0x3C);
                unsigned x0 = (v0 << 2 | v1 >> 4) & 0xFF;
                unsigned x1 = ((v5 & 15) << 4 | v6 >> 2) & 0xFF;
                unsigned x2 = ((v10 & 3) << 6 | v11) & 0xFF;
                unsigned m = x0 > x1 ? x0 : x1;
                m = m > x2 ? m : x2;
                mx = mx > m ? mx : m;
                o[0] = (unsigned char)x0;
                o[1] = (unsigned char)x1;
                o[2] = (unsigned char)x2;
            }
            if (bad) break;  /* this chunk again on the general path (which may decline) */
            if (mx >= limit) return 0;
            done += 3 * blocks;
            pos += 16 * blocks;
        }
    }
    /* general path from here: 4 characters -> 3 bytes, gathered into int32 */
    unsigned char word[4];
    int have = 0;
    while (pos < len) {
        unsigned char q[3];
        int nbytes = 3;
        if (len - pos < 4) return 0;
        if (c[pos + 3] == '=') {
            /* padding: only in the last quad, "xx==" or "xxx=" with zero stray bits */
            if (len - pos != 4) return 0;
            unsigned char tmp[4] = {c[pos], c[pos + 1], 'A', 'A'};
            if (c[pos + 2] == '=') {
                nbytes = 1;
                if (B64[c[pos + 1]] != 0xFF && (B64[c[pos + 1]] & 15)) return 0;
            } else {
                nbytes = 2;
                tmp[2] = c[pos + 2];
                if (B64[c[pos + 2]] != 0xFF && (B64[c[pos + 2]] & 3)) return 0;
            }
            if (!quad(tmp, q)) return 0;
        } else if (!quad(c + pos, q)) {
            return 0;
        }
        pos += 4;
        for (int j = 0; j < nbytes; j++) {
            word[have++] = q[j];
            if (have == 4) {
                uint32_t v = (uint32_t)word[0] | (uint32_t)word[1] << 8 |
                             (uint32_t)word[2] << 16 | (uint32_t)word[3] << 24;
                if (v >= limit || done >= count) return 0;
                if (wide) {
                    int32_t sv = (int32_t)v;
                    memcpy(dst + 4 * done, &sv, 4);
                } else {
                    dst[done] = (unsigned char)v;
                }
                done++;
                have = 0;
            }
        }
    }
    return have == 0 && done == count;
}

static PyObject *
experts(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t start, end;
    long long num_experts;
    if (!PyArg_ParseTuple(args, "y*nnL", &view, &start, &end, &num_experts)) return NULL;
    PyObject *res = NULL, *out = NULL;
    const unsigned char *b = view.buf;
    Py_ssize_t n = view.len;
    if (start < 0 || start > n || end > n || num_experts < 1 || num_experts > 0x7FFFFFFFLL) {
        PyErr_SetString(PyExc_ValueError, "experts: start/end outside the buffer or bad "
                        "num_experts");
        goto done;
    }
    if (end < 0) {
        const unsigned char *q = memchr(b + start, '"', (size_t)(n - start));
        if (q == NULL) { res = Py_BuildValue("(On)", Py_None, (Py_ssize_t)-1); goto done; }
        end = q - b;
    }
    if (end < start) {
        PyErr_SetString(PyExc_ValueError, "experts: end before start");
        goto done;
    }
    Py_ssize_t len = end - start;
    if (len % 4) { res = Py_BuildValue("(On)", Py_None, end); goto done; }
    Py_ssize_t nbytes = len / 4 * 3;
    if (len && b[end - 1] == '=') nbytes -= (len >= 2 && b[end - 2] == '=') ? 2 : 1;
    if (nbytes % 4) { res = Py_BuildValue("(On)", Py_None, end); goto done; }
    Py_ssize_t count = nbytes / 4;
    int wide = num_experts > 256;
    out = PyByteArray_FromStringAndSize(NULL, count * (wide ? 4 : 1));
    if (out == NULL) goto done;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = decode_ids(b + start, len, count, (unsigned char *)PyByteArray_AS_STRING(out), wide,
                    (uint32_t)num_experts);
    Py_END_ALLOW_THREADS
    res = ok ? Py_BuildValue("(On)", out, end) : Py_BuildValue("(On)", Py_None, end);
done:
    Py_XDECREF(out);
    PyBuffer_Release(&view);
    return res;
}

/* ------------------------------------------------------------------ rows_json */

/* rows_json(lps_text, ids_text, k) -> bytes: SGLang's logprob rows written from the two
 * columns' JSON texts (orjson's "[a,b,...]" of the flat logprobs and ids, n > 0 numbers
 * each): k == 0 gives [[lp,id,null],...], k > 0 rows of k entries [[[lp,id,null],...],...].
 * Exactly LogprobRows.to_json's bytes (the same number texts, joined here instead of
 * through a Python list of one bytes object per number). None when the texts do not hold
 * the same count of numbers, n is not a multiple of k, or a text is not "[...]". */
static PyObject *
rows_json(PyObject *self, PyObject *args)
{
    Py_buffer a, b;
    Py_ssize_t k;
    if (!PyArg_ParseTuple(args, "y*y*n", &a, &b, &k)) return NULL;
    PyObject *res = NULL;
    const char *x = a.buf, *y = b.buf;
    Py_ssize_t nx = a.len, ny = b.len;
    if (k < 0 || nx < 3 || ny < 3 || x[0] != '[' || x[nx - 1] != ']' || y[0] != '[' ||
        y[ny - 1] != ']') {
        res = Py_NewRef(Py_None);
        goto done;
    }
    Py_ssize_t n = 1, m = 1;
    for (Py_ssize_t i = 1; i < nx - 1; i++) n += x[i] == ',';
    for (Py_ssize_t i = 1; i < ny - 1; i++) m += y[i] == ',';
    if (n != m || (k > 0 && n % k)) { res = Py_NewRef(Py_None); goto done; }
    /* numbers, their separators, per entry "[" "," ",null]" and "," (+ row brackets) */
    Py_ssize_t size = (nx - 2) + (ny - 2) + n * 9 + 4 + (k > 0 ? 3 * (n / k) + 2 : 0);
    res = PyBytes_FromStringAndSize(NULL, size);
    if (res == NULL) goto done;
    char *o = PyBytes_AS_STRING(res);
    Py_ssize_t pos = 0, xi = 1, yi = 1;
    o[pos++] = '[';
    for (Py_ssize_t e = 0; e < n; e++) {
        if (k > 0 && e % k == 0) {
            if (e) o[pos++] = ',';
            o[pos++] = '[';
        } else if (e) {
            o[pos++] = ',';
        }
        o[pos++] = '[';
        Py_ssize_t xe = xi;
        while (xe < nx - 1 && x[xe] != ',') xe++;
        memcpy(o + pos, x + xi, (size_t)(xe - xi));
        pos += xe - xi;
        xi = xe + 1;
        o[pos++] = ',';
        Py_ssize_t ye = yi;
        while (ye < ny - 1 && y[ye] != ',') ye++;
        memcpy(o + pos, y + yi, (size_t)(ye - yi));
        pos += ye - yi;
        yi = ye + 1;
        memcpy(o + pos, ",null]", 6);
        pos += 6;
        if (k > 0 && e % k == k - 1) o[pos++] = ']';
    }
    o[pos++] = ']';
    if (_PyBytes_Resize(&res, pos) < 0) res = NULL;
done:
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return res;
}

/* ------------------------------------------------------------------ land */

typedef struct {
    PyObject_HEAD
    PyObject *bytes; /* the bytes object whose storage this exports, writable */
} Landing;

static int
landing_getbuffer(PyObject *self, Py_buffer *view, int flags)
{
    PyObject *b = ((Landing *)self)->bytes;
    return PyBuffer_FillInfo(view, self, PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b), 0, flags);
}

static void
landing_dealloc(PyObject *self)
{
    Py_XDECREF(((Landing *)self)->bytes);
    Py_TYPE(self)->tp_free(self);
}

static PyBufferProcs landing_as_buffer = {landing_getbuffer, NULL};

static PyTypeObject LandingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rollout_gateway._native.Landing",
    .tp_basicsize = sizeof(Landing),
    .tp_dealloc = landing_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_as_buffer = &landing_as_buffer,
    .tp_doc = "The writable storage of a bytes object made by land(n).",
};

static PyObject *
land(PyObject *self, PyObject *arg)
{
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "land(n): n must be >= 0");
        return NULL;
    }
    PyObject *b = PyBytes_FromStringAndSize(NULL, n);
    if (b == NULL) return NULL;
    Landing *w = PyObject_New(Landing, &LandingType);
    if (w == NULL) {
        Py_DECREF(b);
        return NULL;
    }
    w->bytes = Py_NewRef(b);
    return Py_BuildValue("(NN)", b, (PyObject *)w);
}

/* ------------------------------------------------------------------ module */

static PyMethodDef methods[] = {
    {"top_rows", top_rows, METH_O,
     "top_rows(seg) -> (float64 bytes, int64 bytes, t, k) | None: canonical top logprobs."},
    {"cut_columns", cut_columns, METH_O,
     "cut_columns(body) -> (ids | None, token rows | None, top rows | None) | None: "
     "output_ids, output_token_logprobs and output_top_logprobs as columns."},
    {"rows_json", rows_json, METH_VARARGS,
     "rows_json(lps_text, ids_text, k) -> bytes | None: logprob rows written from columns."},
    {"experts", experts, METH_VARARGS,
     "experts(buf, start, end, num_experts) -> (ids bytes | None, end): routed experts."},
    {"land", land, METH_O,
     "land(n) -> (bytes, writer): n bytes, not initialised, and their writable storage."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native",
    "Compiled parsers of the gateway's data plane (see rollout_gateway/native.py).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__native(void)
{
    init_b64();
#if defined(__x86_64__) && LDBL_MANT_DIG == 64
    P10L[0] = 1.0L;
    for (int j = 1; j < 28; j++) P10L[j] = P10L[j - 1] * 10.0L;
#endif
    if (PyType_Ready(&LandingType) < 0) return NULL;
    return PyModule_Create(&module);
}
