/* OTLP ExportTraceServiceRequest protobuf bytes -> otel_traces columns, in one pass over the wire format.

   collector/spans.py builds Arrow arrays from the buffers this fills, without a Python object per span
   or per attribute. The values are the exporter's encodings (collector/values.py is the specification
   this follows byte for byte): ids as lowercase hex, attribute values as pdata's Value.AsString()
   (ints in decimal, doubles in Go's shortest form, bytes base64, arrays and maps as JSON), a repeated
   attribute key keeping its last value at its first position.

   Every column is a buffer; a string column is two (bytes, then int32 end offsets starting at 0), a map
   column five (int32 entry offsets per row, then keys and values as string columns):

       SpanAttributes  row offsets [0, 3, 5, ...]   keys "k0k1k2k0k3" + [0, 2, 4, 6, 8, 10]  values (same)

   `ss_feed` appends the rows of one request; a request that does not parse leaves the buffers as they
   were and returns -1 with a message. A span without a valid trace or span id is counted and left out
   (its rows are rolled back). Nothing here holds the GIL: ctypes releases it around each call. */

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define STR(name) name, name##_OFF
#define MAP(name) name##_OFF, name##_K, name##_K_OFF, name##_V, name##_V_OFF

enum {
    TS, DUR, KIND, CODE, SCOPE,
    STR(TID), STR(SID), STR(PSID), STR(TSTATE), STR(NAME), STR(SMSG),
    MAP(SA),
    EV_OFF, EV_TS, STR(EV_NAME), MAP(EA),
    LN_OFF, STR(LN_TID), STR(LN_SID), STR(LN_STATE), MAP(LA),
    MAP(RA), STR(RSERVICE),
    SC_RES, STR(SC_NAME), STR(SC_VERSION),
    MAP(RR),
    NBUF
};

/* The buffer names in enum order, for the Python side. */
static const char BUFFER_NAMES[] =
    "ts,dur,kind,code,scope,"
    "tid,tid_off,sid,sid_off,psid,psid_off,tstate,tstate_off,name,name_off,smsg,smsg_off,"
    "sa_off,sa_k,sa_k_off,sa_v,sa_v_off,"
    "ev_off,ev_ts,ev_name,ev_name_off,ea_off,ea_k,ea_k_off,ea_v,ea_v_off,"
    "ln_off,ln_tid,ln_tid_off,ln_sid,ln_sid_off,ln_state,ln_state_off,la_off,la_k,la_k_off,la_v,la_v_off,"
    "ra_off,ra_k,ra_k_off,ra_v,ra_v_off,rservice,rservice_off,"
    "sc_res,sc_name,sc_name_off,sc_version,sc_version_off,"
    "rr_off,rr_k,rr_k_off,rr_v,rr_v_off";

#define MAX_DEPTH 64 /* AnyValue nesting (arrays in arrays...) */

typedef struct {
    char *p;
    int64_t len, cap;
} buf_t;

typedef struct {
    buf_t b[NBUF];
    int64_t rows, rejected, resources, scopes; /* counts: keep these right after the buffers */
    int64_t check_only; /* parse, validate and count, but format no attribute value (ss_check) */
    char error[256];
} decoder_t;

typedef struct {
    int64_t len[NBUF];
    int64_t rows, rejected, resources, scopes;
} mark_t;

typedef struct {
    const uint8_t *p, *end;
} reader_t;

/* --- buffers -------------------------------------------------------------------------------------- */

static int fail(decoder_t *d, const char *message) {
    if (!d->error[0]) snprintf(d->error, sizeof d->error, "%s", message);
    return -1;
}

static int reserve(decoder_t *d, buf_t *b, int64_t more) {
    if (b->len + more <= b->cap) return 0;
    int64_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + more) cap *= 2;
    char *p = realloc(b->p, (size_t)cap);
    if (!p) return fail(d, "out of memory");
    b->p = p;
    b->cap = cap;
    return 0;
}

static int put(decoder_t *d, int i, const void *src, int64_t n) {
    buf_t *b = &d->b[i];
    if (reserve(d, b, n)) return -1;
    memcpy(b->p + b->len, src, (size_t)n);
    b->len += n;
    return 0;
}

static int put_i32(decoder_t *d, int i, int64_t v) {
    if (v > INT32_MAX) return fail(d, "too many rows or bytes for one batch");
    int32_t x = (int32_t)v;
    return put(d, i, &x, 4);
}

static int put_i64(decoder_t *d, int i, int64_t v) { return put(d, i, &v, 8); }

/* Close the string being built at the end of data buffer `i`: its end offset goes to buffer i + 1. */
static int end_str(decoder_t *d, int i) { return put_i32(d, i + 1, d->b[i].len); }

static int put_str(decoder_t *d, int i, const uint8_t *s, int64_t n) {
    if (put(d, i, s, n)) return -1;
    return end_str(d, i);
}

static int64_t entries(decoder_t *d, int map) { return d->b[map + 2].len / 4 - 1; }

static void mark(decoder_t *d, mark_t *m) {
    for (int i = 0; i < NBUF; i++) m->len[i] = d->b[i].len;
    m->rows = d->rows, m->rejected = d->rejected, m->resources = d->resources, m->scopes = d->scopes;
}

static void rollback(decoder_t *d, const mark_t *m) {
    for (int i = 0; i < NBUF; i++) d->b[i].len = m->len[i];
    d->rows = m->rows, d->rejected = m->rejected, d->resources = m->resources, d->scopes = m->scopes;
}

/* --- the wire format ------------------------------------------------------------------------------ */

enum { VARINT = 0, I64 = 1, LEN = 2, SGROUP = 3, EGROUP = 4, I32 = 5 };

static int varint(decoder_t *d, reader_t *r, uint64_t *out) {
    uint64_t v = 0;
    for (int shift = 0; shift < 70; shift += 7) {
        if (r->p >= r->end) return fail(d, "truncated varint");
        uint8_t byte = *r->p++;
        v |= (uint64_t)(byte & 0x7f) << shift;
        if (!(byte & 0x80)) {
            *out = v;
            return 0;
        }
    }
    return fail(d, "varint longer than 10 bytes");
}

static int tag(decoder_t *d, reader_t *r, uint32_t *field, int *wire) {
    uint64_t t;
    if (varint(d, r, &t)) return -1;
    if (t >> 32 || (t >> 3) == 0) return fail(d, "invalid field number");
    *field = (uint32_t)(t >> 3);
    *wire = (int)(t & 7);
    return 0;
}

static int fixed64(decoder_t *d, reader_t *r, uint64_t *out) {
    if (r->end - r->p < 8) return fail(d, "truncated fixed64");
    memcpy(out, r->p, 8); /* little-endian, as x86 and arm64 */
    r->p += 8;
    return 0;
}

static int bytes(decoder_t *d, reader_t *r, reader_t *out) {
    uint64_t n;
    if (varint(d, r, &n)) return -1;
    if (n > (uint64_t)(r->end - r->p)) return fail(d, "length past the end of the message");
    out->p = r->p;
    out->end = r->p + n;
    r->p += n;
    return 0;
}

static int skip(decoder_t *d, reader_t *r, uint32_t field, int wire, int depth) {
    uint64_t v;
    reader_t sub;
    switch (wire) {
    case VARINT: return varint(d, r, &v);
    case I64: return fixed64(d, r, &v);
    case LEN: return bytes(d, r, &sub);
    case I32:
        if (r->end - r->p < 4) return fail(d, "truncated fixed32");
        r->p += 4;
        return 0;
    case SGROUP:
        if (depth > 100) return fail(d, "groups nested too deep");
        for (;;) {
            uint32_t f;
            int w;
            if (r->p >= r->end) return fail(d, "unterminated group");
            if (tag(d, r, &f, &w)) return -1;
            if (w == EGROUP) return f == field ? 0 : fail(d, "mismatched end of group");
            if (skip(d, r, f, w, depth + 1)) return -1;
        }
    default: return fail(d, "invalid wire type");
    }
}

/* Strict UTF-8 (no overlong forms, surrogates or code points past U+10FFFF), as protobuf requires of
   `string` fields. */
static int utf8(decoder_t *d, const uint8_t *s, int64_t n) {
    const uint8_t *end = s + n;
    while (s < end) {
        if (end - s >= 8) {
            uint64_t w;
            memcpy(&w, s, 8);
            if (!(w & 0x8080808080808080ULL)) {
                s += 8;
                continue;
            }
        }
        uint8_t c = *s;
        if (c < 0x80) {
            s++;
            continue;
        }
        int need;
        uint32_t cp;
        if (c >= 0xc2 && c <= 0xdf) need = 1, cp = c & 0x1f;
        else if (c >= 0xe0 && c <= 0xef) need = 2, cp = c & 0x0f;
        else if (c >= 0xf0 && c <= 0xf4) need = 3, cp = c & 0x07;
        else return fail(d, "invalid UTF-8 in a string field");
        if (end - s <= need) return fail(d, "invalid UTF-8 in a string field");
        for (int k = 1; k <= need; k++) {
            if ((s[k] & 0xc0) != 0x80) return fail(d, "invalid UTF-8 in a string field");
            cp = (cp << 6) | (s[k] & 0x3f);
        }
        if ((need == 2 && (cp < 0x800 || (cp >= 0xd800 && cp <= 0xdfff))) ||
            (need == 3 && (cp < 0x10000 || cp > 0x10ffff)))
            return fail(d, "invalid UTF-8 in a string field");
        s += need + 1;
    }
    return 0;
}

static int string_field(decoder_t *d, reader_t *r, reader_t *out) {
    if (bytes(d, r, out)) return -1;
    return utf8(d, out->p, out->end - out->p);
}

/* --- value encodings ------------------------------------------------------------------------------ */

static int put_hex(decoder_t *d, int i, const uint8_t *s, int64_t n) {
    static const char digits[] = "0123456789abcdef";
    buf_t *b = &d->b[i];
    if (reserve(d, b, 2 * n)) return -1;
    char *o = b->p + b->len;
    for (int64_t k = 0; k < n; k++) {
        o[2 * k] = digits[s[k] >> 4];
        o[2 * k + 1] = digits[s[k] & 15];
    }
    b->len += 2 * n;
    return 0;
}

static int put_int(decoder_t *d, int i, int64_t v) {
    char tmp[24], *o = tmp + sizeof tmp;
    uint64_t u = v < 0 ? 0 - (uint64_t)v : (uint64_t)v;
    do *--o = (char)('0' + u % 10);
    while (u /= 10);
    if (v < 0) *--o = '-';
    return put(d, i, o, tmp + sizeof tmp - o);
}

static int put_base64(decoder_t *d, int i, const uint8_t *s, int64_t n) {
    static const char alphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    buf_t *b = &d->b[i];
    if (reserve(d, b, (n + 2) / 3 * 4)) return -1;
    char *o = b->p + b->len;
    int64_t k = 0;
    for (; k + 3 <= n; k += 3) {
        uint32_t v = (uint32_t)s[k] << 16 | (uint32_t)s[k + 1] << 8 | s[k + 2];
        *o++ = alphabet[v >> 18], *o++ = alphabet[(v >> 12) & 63];
        *o++ = alphabet[(v >> 6) & 63], *o++ = alphabet[v & 63];
    }
    if (n - k == 1) {
        uint32_t v = (uint32_t)s[k] << 16;
        *o++ = alphabet[v >> 18], *o++ = alphabet[(v >> 12) & 63], *o++ = '=', *o++ = '=';
    } else if (n - k == 2) {
        uint32_t v = (uint32_t)s[k] << 16 | (uint32_t)s[k + 1] << 8;
        *o++ = alphabet[v >> 18], *o++ = alphabet[(v >> 12) & 63], *o++ = alphabet[(v >> 6) & 63], *o++ = '=';
    }
    b->len = o - b->p;
    return 0;
}

static const double POW10[] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,  1e8,  1e9,  1e10, 1e11,
                               1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

/* The `len`-digit decimal that reads back as x (normal, > 0), found with exact double arithmetic: -1 when
   there is none, -2 when this cannot tell. The scaled value t = x * 10^k (one rounding, so within 0.2 of
   the exact product) has its nearest integer m within 1 of every `len`-digit candidate that could read back
   (the interval that reads back as x is under one unit of the last digit each side), so the candidates are
   m - 1, m, m + 1; each is checked exactly by Clinger's fast path (an integer under 2^53 times or over an
   exact power of ten is one correctly rounded operation). Two that read back: the nearest is wanted, and
   that is left to the slow path. */
static int exact_digits(double x, int len, int k, uint64_t *out) {
    if (k < -22 || k > 22) return -2;
    double m = nearbyint(k >= 0 ? x * POW10[k] : x / POW10[-k]), low = POW10[len - 1], high = POW10[len];
    if (m < low || m >= high || m + 1 > 9007199254740992.0) return -2;
    int found = 0;
    for (double c = m - 1; c <= m + 1; c++) {
        if (c < low || c >= high) continue;
        if ((k >= 0 ? c / POW10[k] : c * POW10[-k]) == x) {
            if (found) return -2;
            *out = (uint64_t)c;
            found = 1;
        }
    }
    return found ? 0 : -1;
}

/* The shortest decimal digits that read back as x (finite, > 0), as Python's repr finds them:
   digits[0..n) with x = 0.d1d2...dn * 10^decpt. When the shortest has at most 15 digits, the 15-digit
   decimal that reads back is unique and is it padded with zeros; past that, the 16-digit one (the nearest,
   should two read back) or the correctly rounded 17 digits. Exact double arithmetic settles most values
   (exact_digits); the rest take glibc's correctly rounded printf and strtod, which for 16 digits also try
   the nearest's neighbour on the far side (near a power of two it can be the one that reads back).
   Subnormals (fewer significant bits) try every length from 1. */
static int shortest(double x, char *digits, int *decpt) {
    char tmp[40];
    int first = 15;
    if (x >= 2.2250738585072014e-308) {
        int k = 14 - (int)floor(log10(x));
        uint64_t m;
        int r15 = exact_digits(x, 15, k, &m), r16 = r15 == -1 ? exact_digits(x, 16, k + 1, &m) : -2;
        if (r15 == 0 || r16 == 0) {
            int n = r15 == 0 ? 15 : 16;
            for (int i = n - 1; i >= 0; i--, m /= 10) digits[i] = (char)('0' + m % 10);
            *decpt = 15 - k;
            while (n > 1 && digits[n - 1] == '0') n--;
            return n;
        }
        first = r15 == -1 ? (r16 == -1 ? 17 : 16) : 15;
    } else {
        first = 1;
    }
    for (int prec = first; prec <= 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*e", prec - 1, x);
        char *e = strchr(tmp, 'e');
        int n = 0;
        for (char *c = tmp; c < e; c++)
            if (*c != '.') digits[n++] = *c;
        int exp10 = atoi(e + 1);
        double back = strtod(tmp, NULL);
        if (back != x && prec == 16) {
            char alt[20], text[40];
            int alt_exp = exp10, k = n - 1;
            memcpy(alt, digits, (size_t)n);
            if (back < x) { /* one up in the last digit, carrying */
                while (k >= 0 && alt[k] == '9') alt[k--] = '0';
                if (k < 0) alt[0] = '1', alt_exp++;
                else alt[k]++;
            } else { /* one down, borrowing */
                while (k >= 0 && alt[k] == '0') alt[k--] = '9';
                alt[k]--;
                if (alt[0] == '0') memmove(alt, alt + 1, (size_t)(n - 1)), alt[n - 1] = '9', alt_exp--;
            }
            snprintf(text, sizeof text, "%c.%.*se%d", alt[0], n - 1, alt + 1, alt_exp);
            if (strtod(text, NULL) == x) memcpy(digits, alt, (size_t)n), exp10 = alt_exp, back = x;
        }
        if (back == x || prec == 17) {
            while (n > 1 && digits[n - 1] == '0') n--;
            *decpt = exp10 + 1;
            return n;
        }
    }
    return 0; /* not reached */
}

static int put_fixed(decoder_t *d, int i, const char *digits, int n, int decpt) {
    static const char zeros[] = "0000000000000000000000000";
    if (decpt <= 0) {
        if (put(d, i, "0.", 2) || put(d, i, zeros, -decpt)) return -1;
        return put(d, i, digits, n);
    }
    if (decpt >= n) return put(d, i, digits, n) || put(d, i, zeros, decpt - n);
    return put(d, i, digits, decpt) || put(d, i, ".", 1) || put(d, i, digits + decpt, n - decpt);
}

static int put_exponent(decoder_t *d, int i, int e, int min_digits) {
    char tmp[8];
    int n = snprintf(tmp, sizeof tmp, "e%c%0*d", e < 0 ? '-' : '+', min_digits, e < 0 ? -e : e);
    return put(d, i, tmp, n);
}

/* values.float_str: Go's formatting of a double (2.0 -> "2", 1e-07 -> "1e-7", 1e21 -> "1e+21"). */
static int put_go_float(decoder_t *d, int i, double x) {
    if (isnan(x)) return put(d, i, "NaN", 3);
    if (isinf(x)) return put(d, i, x > 0 ? "+Inf" : "-Inf", 4);
    double a = fabs(x);
    if (x == 0) return put(d, i, "0", 1);
    if (a < 1e21 && x == trunc(x)) { /* str(int(x)): exact, as glibc prints it */
        char tmp[32];
        int n = snprintf(tmp, sizeof tmp, "%.0f", x);
        return put(d, i, tmp, n);
    }
    char digits[20];
    int decpt, n = shortest(a, digits, &decpt);
    if (x < 0 && put(d, i, "-", 1)) return -1;
    if (a >= 1e-6 && a < 1e21) return put_fixed(d, i, digits, n, decpt);
    if (put(d, i, digits, 1)) return -1;
    if (n > 1 && (put(d, i, ".", 1) || put(d, i, digits + 1, n - 1))) return -1;
    return put_exponent(d, i, decpt - 1, 1);
}

/* Python's repr of a finite double (what json.dumps writes): 2.0 -> "2.0", 1e-05 -> "1e-05". */
static int put_py_float(decoder_t *d, int i, double x) {
    if (x == 0) return signbit(x) ? put(d, i, "-0.0", 4) : put(d, i, "0.0", 3);
    char digits[20];
    int decpt, n = shortest(fabs(x), digits, &decpt);
    if (x < 0 && put(d, i, "-", 1)) return -1;
    if (decpt > -4 && decpt <= 16) {
        if (put_fixed(d, i, digits, n, decpt)) return -1;
        return decpt >= n ? put(d, i, ".0", 2) : 0;
    }
    if (put(d, i, digits, 1)) return -1;
    if (n > 1 && (put(d, i, ".", 1) || put(d, i, digits + 1, n - 1))) return -1;
    return put_exponent(d, i, decpt - 1, 2);
}

/* A JSON string as json.dumps(ensure_ascii=False) writes it. */
static int put_json_str(decoder_t *d, int i, const uint8_t *s, int64_t n) {
    static const char hex[] = "0123456789abcdef";
    if (put(d, i, "\"", 1)) return -1;
    int64_t run = 0;
    for (int64_t k = 0; k < n; k++) {
        uint8_t c = s[k];
        if (c >= 0x20 && c != '"' && c != '\\') continue;
        if (put(d, i, s + run, k - run)) return -1;
        run = k + 1;
        char esc[6] = {'\\', 0};
        int m = 2;
        switch (c) {
        case '"': esc[1] = '"'; break;
        case '\\': esc[1] = '\\'; break;
        case '\n': esc[1] = 'n'; break;
        case '\r': esc[1] = 'r'; break;
        case '\t': esc[1] = 't'; break;
        case '\b': esc[1] = 'b'; break;
        case '\f': esc[1] = 'f'; break;
        default: esc[1] = 'u', esc[2] = '0', esc[3] = '0', esc[4] = hex[c >> 4], esc[5] = hex[c & 15], m = 6;
        }
        if (put(d, i, esc, m)) return -1;
    }
    return put(d, i, s + run, n - run) || put(d, i, "\"", 1);
}

/* --- AnyValue ------------------------------------------------------------------------------------- */

enum { V_NONE, V_STRING, V_BOOL, V_INT, V_DOUBLE, V_ARRAY, V_KVLIST, V_BYTES };

typedef struct {
    int kind;
    uint64_t num; /* bool, int, double bits */
    reader_t data; /* string, bytes, array, kvlist */
} value_t;

/* Read an AnyValue's oneof (the last field of it on the wire wins; a field with another wire type than
   its own is an unknown field, as in protobuf's parsers). Strings are checked as UTF-8. */
static int any_value(decoder_t *d, reader_t r, value_t *v) {
    v->kind = V_NONE;
    while (r.p < r.end) {
        uint32_t f;
        int w;
        if (tag(d, &r, &f, &w)) return -1;
        if ((f == 1 || f == 5 || f == 6 || f == 7) && w == LEN) {
            if (bytes(d, &r, &v->data)) return -1;
            if (f == 1 && utf8(d, v->data.p, v->data.end - v->data.p)) return -1;
            v->kind = f == 1 ? V_STRING : f == 5 ? V_ARRAY : f == 6 ? V_KVLIST : V_BYTES;
        } else if ((f == 2 || f == 3) && w == VARINT) {
            if (varint(d, &r, &v->num)) return -1;
            v->kind = f == 2 ? V_BOOL : V_INT;
        } else if (f == 4 && w == I64) {
            if (fixed64(d, &r, &v->num)) return -1;
            v->kind = V_DOUBLE;
        } else if (skip(d, &r, f, w, 0)) {
            return -1;
        }
    }
    return 0;
}

static double as_double(uint64_t bits) {
    double x;
    memcpy(&x, &bits, 8);
    return x;
}

/* A KeyValue's key and value slices (the last of each on the wire); the key checked as UTF-8. */
static int key_value(decoder_t *d, reader_t r, reader_t *key, reader_t *value, int *has_value) {
    key->p = key->end = r.p;
    *has_value = 0;
    while (r.p < r.end) {
        uint32_t f;
        int w;
        if (tag(d, &r, &f, &w)) return -1;
        if (f == 1 && w == LEN) {
            if (string_field(d, &r, key)) return -1;
        } else if (f == 2 && w == LEN) {
            if (bytes(d, &r, value)) return -1;
            *has_value = 1;
        } else if (skip(d, &r, f, w, 0)) {
            return -1;
        }
    }
    return 0;
}

static int json_value(decoder_t *d, int i, const value_t *v, int depth);

static int json_of(decoder_t *d, int i, reader_t r, int has, int depth) {
    value_t v;
    if (depth > MAX_DEPTH) return fail(d, "attribute values nested too deep");
    if (!has) return put(d, i, "null", 4);
    if (any_value(d, r, &v)) return -1;
    return json_value(d, i, &v, depth);
}

/* An ArrayValue's or KeyValueList's elements are field 1 of it; anything else is skipped. */
static int next_element(decoder_t *d, reader_t *r, reader_t *element, int *found) {
    *found = 0;
    while (r->p < r->end) {
        uint32_t f;
        int w;
        if (tag(d, r, &f, &w)) return -1;
        if (f == 1 && w == LEN) {
            *found = 1;
            return bytes(d, r, element);
        }
        if (skip(d, r, f, w, 0)) return -1;
    }
    return 0;
}

/* Keys as (start, end) byte positions in `base`: key i is base[pos[2i] .. pos[2i + 1]). */
typedef struct {
    const char *base;
    const int64_t *pos;
} keys_t;

static int key_equal(keys_t k, int64_t a, int64_t b) {
    int64_t len = k.pos[2 * a + 1] - k.pos[2 * a];
    return len == k.pos[2 * b + 1] - k.pos[2 * b] && !memcmp(k.base + k.pos[2 * a], k.base + k.pos[2 * b], (size_t)len);
}

/* first[i] = the index of the first key equal to key i (i itself for a first occurrence). Returns 1 when
   some key repeats, 0 when none does, -1 when out of memory. Pairwise for a few keys; a hash table past
   that, so that a request with a huge attribute list costs linear time, not quadratic. */
static int first_keys(decoder_t *d, keys_t k, int64_t n, int64_t *first) {
    int repeated = 0;
    if (n <= 16) {
        for (int64_t a = 0; a < n; a++) {
            first[a] = a;
            for (int64_t b = 0; b < a; b++)
                if (first[b] == b && key_equal(k, a, b)) {
                    first[a] = b, repeated = 1;
                    break;
                }
        }
        return repeated;
    }
    uint64_t cap = 32;
    while (cap < 2 * (uint64_t)n) cap *= 2;
    int64_t *slot = malloc(cap * sizeof *slot);
    if (!slot) return fail(d, "out of memory");
    memset(slot, 0xff, cap * sizeof *slot); /* -1: empty */
    for (int64_t a = 0; a < n; a++) {
        uint64_t h = 1469598103934665603ULL; /* FNV-1a */
        for (int64_t c = k.pos[2 * a]; c < k.pos[2 * a + 1]; c++) h = (h ^ (uint8_t)k.base[c]) * 1099511628211ULL;
        for (h &= cap - 1; slot[h] >= 0 && !key_equal(k, slot[h], a); h = (h + 1) & (cap - 1)) {
        }
        if (slot[h] >= 0) first[a] = slot[h], repeated = 1;
        else slot[h] = first[a] = a;
    }
    free(slot);
    return repeated;
}

/* A KeyValueList as a JSON object with dict semantics: each key once, at its first position, with its
   last value. Entries are rendered into the end of buffer `i` first, then rewritten in that order. */
static int json_kvlist(decoder_t *d, int i, reader_t r, int depth) {
    buf_t *b = &d->b[i];
    int64_t start = b->len, n = 0, cap = 0;
    int64_t *pos = NULL, *first = NULL; /* per entry: key start, key end, value start, value end */
    int rc = -1;
    for (;;) {
        reader_t element, key, value;
        int found, has;
        if (next_element(d, &r, &element, &found)) goto out;
        if (!found) break;
        if (key_value(d, element, &key, &value, &has)) goto out;
        if (n == cap) {
            cap = cap ? 2 * cap : 8;
            int64_t *grown = realloc(pos, (size_t)cap * 4 * sizeof *pos);
            if (!grown) {
                fail(d, "out of memory");
                goto out;
            }
            pos = grown;
        }
        pos[4 * n] = b->len;
        if (put_json_str(d, i, key.p, key.end - key.p)) goto out;
        pos[4 * n + 1] = pos[4 * n + 2] = b->len;
        if (json_of(d, i, value, has, depth + 1)) goto out;
        pos[4 * n + 3] = b->len;
        n++;
    }
    {
        /* keys[2j], keys[2j + 1]: key j's bytes; last[f]: the last entry with the key of first occurrence f */
        int64_t *keys = malloc((size_t)(2 * n + 1) * sizeof *keys);
        first = malloc((size_t)(2 * n + 1) * sizeof *first);
        if (!keys || !first) {
            free(keys);
            fail(d, "out of memory");
            goto out;
        }
        int64_t *last = first + n;
        for (int64_t j = 0; j < n; j++) keys[2 * j] = pos[4 * j], keys[2 * j + 1] = pos[4 * j + 1];
        int repeated = first_keys(d, (keys_t){b->p, keys}, n, first);
        free(keys);
        if (repeated < 0) goto out;
        for (int64_t j = 0; j < n; j++) last[first[j]] = j;
        int64_t rendered = b->len;
        /* room for the object at once, so that the entries copied from this buffer never move */
        if (reserve(d, b, rendered - start + n + 2) || put(d, i, "{", 1)) goto out;
        int comma = 0;
        for (int64_t j = 0; j < n; j++) {
            if (first[j] != j) continue;
            int64_t v = last[j];
            if ((comma && put(d, i, ",", 1)) || put(d, i, b->p + pos[4 * j], pos[4 * j + 1] - pos[4 * j]) ||
                put(d, i, ":", 1) || put(d, i, b->p + pos[4 * v + 2], pos[4 * v + 3] - pos[4 * v + 2]))
                goto out;
            comma = 1;
        }
        if (put(d, i, "}", 1)) goto out;
        int64_t size = b->len - rendered;
        memmove(b->p + start, b->p + rendered, (size_t)size);
        b->len = start + size;
    }
    rc = 0;
out:
    free(pos);
    free(first);
    return rc;
}

static int json_value(decoder_t *d, int i, const value_t *v, int depth) {
    switch (v->kind) {
    case V_STRING: return put_json_str(d, i, v->data.p, v->data.end - v->data.p);
    case V_BOOL: return v->num ? put(d, i, "true", 4) : put(d, i, "false", 5);
    case V_INT: return put_int(d, i, (int64_t)v->num);
    case V_DOUBLE: {
        double x = as_double(v->num);
        if (isfinite(x)) return put_py_float(d, i, x);
        return put(d, i, "\"", 1) || put_go_float(d, i, x) || put(d, i, "\"", 1);
    }
    case V_BYTES:
        return put(d, i, "\"", 1) || put_base64(d, i, v->data.p, v->data.end - v->data.p) || put(d, i, "\"", 1);
    case V_ARRAY: {
        reader_t r = v->data, element;
        int found, comma = 0;
        if (put(d, i, "[", 1)) return -1;
        for (;;) {
            if (next_element(d, &r, &element, &found)) return -1;
            if (!found) break;
            if ((comma && put(d, i, ",", 1)) || json_of(d, i, element, 1, depth + 1)) return -1;
            comma = 1;
        }
        return put(d, i, "]", 1);
    }
    case V_KVLIST: return json_kvlist(d, i, v->data, depth);
    default: return put(d, i, "null", 4);
    }
}

/* values.value_str: an AnyValue as the exporter stores it, appended to data buffer `i`. */
static int value_str(decoder_t *d, int i, reader_t r, int has) {
    value_t v;
    if (!has) return 0;
    if (any_value(d, r, &v)) return -1;
    switch (v.kind) {
    case V_STRING: return put(d, i, v.data.p, v.data.end - v.data.p);
    case V_BOOL: return v.num ? put(d, i, "true", 4) : put(d, i, "false", 5);
    case V_INT: return put_int(d, i, (int64_t)v.num);
    case V_DOUBLE: return put_go_float(d, i, as_double(v.num));
    case V_BYTES: return put_base64(d, i, v.data.p, v.data.end - v.data.p);
    case V_ARRAY:
    case V_KVLIST: return json_value(d, i, &v, 0);
    default: return 0;
    }
}

/* --- attribute maps ------------------------------------------------------------------------------- */

/* One encoded KeyValue appended to the map at `m` (an entry of the row being built). */
static int map_add(decoder_t *d, int m, reader_t r) {
    reader_t key, value;
    int has;
    if (key_value(d, r, &key, &value, &has)) return -1;
    if (d->check_only) { /* validate the value (nested ones by rendering them, into what is dropped) */
        value_t v;
        if (!has || any_value(d, value, &v)) return has ? -1 : 0;
        return v.kind == V_ARRAY || v.kind == V_KVLIST ? json_value(d, m + 3, &v, 0) : 0;
    }
    if (put_str(d, m + 1, key.p, key.end - key.p)) return -1;
    if (value_str(d, m + 3, value, has)) return -1;
    return end_str(d, m + 3);
}

/* Close the row whose entries start at entry `first`: a repeated key keeps its first position and its
   last value (a Python dict), then the row's end goes to the row offsets. */
static int map_end_row(decoder_t *d, int m, int64_t first) {
    if (d->check_only) return 0;
    int64_t n = entries(d, m) - first, stack[3 * 32], *firsts = stack, *bounds = stack + 32;
    const int32_t *koff = (const int32_t *)d->b[m + 2].p + first, *voff = (const int32_t *)d->b[m + 4].p + first;
    int64_t kbase = koff[0], vbase = voff[0];
    int rc = -1;
    char *keys = NULL, *values = NULL;
    int64_t *last = NULL;
    if (n > 32) { /* bounds: key i at bounds[2i], bounds[2i + 1]; firsts as first_keys fills it */
        firsts = malloc((size_t)(3 * n) * sizeof *firsts), bounds = firsts + n;
        if (!firsts) return fail(d, "out of memory");
    }
    for (int64_t a = 0; a < n; a++) bounds[2 * a] = koff[a], bounds[2 * a + 1] = koff[a + 1];
    int repeated = first_keys(d, (keys_t){d->b[m + 1].p, bounds}, n, firsts);
    if (repeated < 0) goto done;
    if (repeated) { /* rare: copy the row's entries aside, truncate, append them again without repeats */
        int64_t ksize = koff[n] - kbase, vsize = voff[n] - vbase;
        keys = malloc((size_t)ksize + 1), values = malloc((size_t)vsize + 1);
        last = malloc((size_t)(3 * n + 1) * sizeof *last);
        if (!keys || !values || !last) {
            fail(d, "out of memory");
            goto done;
        }
        int64_t *vb = last + n; /* value bounds */
        memcpy(keys, d->b[m + 1].p + kbase, (size_t)ksize);
        memcpy(values, d->b[m + 3].p + vbase, (size_t)vsize);
        for (int64_t a = 0; a < n; a++) {
            bounds[2 * a] -= kbase, bounds[2 * a + 1] -= kbase;
            vb[2 * a] = voff[a] - vbase, vb[2 * a + 1] = voff[a + 1] - vbase;
            last[firsts[a]] = a;
        }
        d->b[m + 1].len = kbase, d->b[m + 3].len = vbase;
        d->b[m + 2].len = d->b[m + 4].len = (first + 1) * 4;
        for (int64_t a = 0; a < n; a++) {
            if (firsts[a] != a) continue;
            int64_t v = last[a];
            if (put_str(d, m + 1, (const uint8_t *)keys + bounds[2 * a], bounds[2 * a + 1] - bounds[2 * a]) ||
                put_str(d, m + 3, (const uint8_t *)values + vb[2 * v], vb[2 * v + 1] - vb[2 * v]))
                goto done;
        }
    }
    rc = put_i32(d, m, entries(d, m));
done:
    if (n > 32) free(firsts);
    free(keys), free(values), free(last);
    return rc;
}

/* The value of `key` in the map row starting at entry `first` (the row already without repeats). */
static int map_get(decoder_t *d, int m, int64_t first, const char *key, const char **value, int64_t *n) {
    const int32_t *koff = (const int32_t *)d->b[m + 2].p, *voff = (const int32_t *)d->b[m + 4].p;
    int64_t klen = (int64_t)strlen(key);
    for (int64_t e = first; e < entries(d, m); e++) {
        if (koff[e + 1] - koff[e] == klen && !memcmp(d->b[m + 1].p + koff[e], key, (size_t)klen)) {
            *value = d->b[m + 3].p + voff[e];
            *n = voff[e + 1] - voff[e];
            return 1;
        }
    }
    return 0;
}

/* --- spans ---------------------------------------------------------------------------------------- */

static const uint8_t ZERO[16];

static int is_zero(reader_t s) { return !memcmp(s.p, ZERO, (size_t)(s.end - s.p)); }

static int64_t size(reader_t s) { return s.end - s.p; }

static int event(decoder_t *d, reader_t r, uint64_t *latest) {
    reader_t name = {r.p, r.p}, sub;
    uint64_t time = 0;
    int64_t first = entries(d, EA_OFF);
    while (r.p < r.end) {
        uint32_t f;
        int w;
        if (tag(d, &r, &f, &w)) return -1;
        if (f == 1 && w == I64) {
            if (fixed64(d, &r, &time)) return -1;
        } else if (f == 2 && w == LEN) {
            if (string_field(d, &r, &name)) return -1;
        } else if (f == 3 && w == LEN) {
            if (bytes(d, &r, &sub) || map_add(d, EA_OFF, sub)) return -1;
        } else if (skip(d, &r, f, w, 0)) {
            return -1;
        }
    }
    if (time > *latest) *latest = time;
    return put_i64(d, EV_TS, (int64_t)time) || put_str(d, EV_NAME, name.p, size(name)) ||
           map_end_row(d, EA_OFF, first);
}

static int put_link_id(decoder_t *d, int i, reader_t id, int64_t full) {
    if (size(id) && !(size(id) == full && is_zero(id)) && put_hex(d, i, id.p, size(id))) return -1;
    return end_str(d, i);
}

static int link(decoder_t *d, reader_t r) {
    reader_t tid = {r.p, r.p}, sid = tid, state = tid, sub;
    int64_t first = entries(d, LA_OFF);
    while (r.p < r.end) {
        uint32_t f;
        int w;
        if (tag(d, &r, &f, &w)) return -1;
        if (f == 1 && w == LEN) {
            if (bytes(d, &r, &tid)) return -1;
        } else if (f == 2 && w == LEN) {
            if (bytes(d, &r, &sid)) return -1;
        } else if (f == 3 && w == LEN) {
            if (string_field(d, &r, &state)) return -1;
        } else if (f == 4 && w == LEN) {
            if (bytes(d, &r, &sub) || map_add(d, LA_OFF, sub)) return -1;
        } else if (skip(d, &r, f, w, 0)) {
            return -1;
        }
    }
    return put_link_id(d, LN_TID, tid, 16) || put_link_id(d, LN_SID, sid, 8) ||
           put_str(d, LN_STATE, state.p, size(state)) || map_end_row(d, LA_OFF, first);
}

static int status(decoder_t *d, reader_t r, reader_t *message, int64_t *code) {
    while (r.p < r.end) {
        uint32_t f;
        int w;
        uint64_t v;
        if (tag(d, &r, &f, &w)) return -1;
        if (f == 2 && w == LEN) {
            if (string_field(d, &r, message)) return -1;
        } else if (f == 3 && w == VARINT) {
            if (varint(d, &r, &v)) return -1;
            *code = (int32_t)v;
        } else if (skip(d, &r, f, w, 0)) {
            return -1;
        }
    }
    return 0;
}

static int span(decoder_t *d, reader_t r, int64_t scope) {
    mark_t before;
    mark(d, &before);
    reader_t empty = {r.p, r.p}, tid = empty, sid = empty, psid = empty, state = empty, name = empty,
             message = empty, sub;
    uint64_t start = 0, end = 0, v, latest_event = 0;
    int64_t kind = 0, code = 0, first_attr = entries(d, SA_OFF);
    while (r.p < r.end) {
        uint32_t f;
        int w;
        if (tag(d, &r, &f, &w)) return -1;
        if (w == LEN && (f <= 5 || f == 9 || f == 11 || f == 13 || f == 15)) {
            if (bytes(d, &r, &sub)) return -1;
            switch (f) {
            case 1: tid = sub; break;
            case 2: sid = sub; break;
            case 3: state = sub; if (utf8(d, sub.p, size(sub))) return -1; break;
            case 4: psid = sub; break;
            case 5: name = sub; if (utf8(d, sub.p, size(sub))) return -1; break;
            case 9: if (map_add(d, SA_OFF, sub)) return -1; break;
            case 11: if (event(d, sub, &latest_event)) return -1; break;
            case 13: if (link(d, sub)) return -1; break;
            case 15: if (status(d, sub, &message, &code)) return -1; break;
            }
        } else if (f == 6 && w == VARINT) {
            if (varint(d, &r, &v)) return -1;
            kind = (int32_t)v;
        } else if ((f == 7 || f == 8) && w == I64) {
            if (fixed64(d, &r, f == 7 ? &start : &end)) return -1;
        } else if (skip(d, &r, f, w, 0)) {
            return -1;
        }
    }
    if (size(tid) != 16 || size(sid) != 8 || is_zero(tid) || is_zero(sid)) {
        rollback(d, &before);
        d->rejected++;
        return 0;
    }
    if (start > INT64_MAX || latest_event > INT64_MAX) return fail(d, "a span or event time is past the year 2262");
    d->rows++;
    return put_i64(d, TS, (int64_t)start) || put_i64(d, DUR, (int64_t)(end > start ? end - start : 0)) ||
           put_i32(d, KIND, kind >= 0 && kind < 6 ? kind : 6) || put_i32(d, CODE, code >= 0 && code < 3 ? code : 3) ||
           put_i32(d, SCOPE, scope) || put_hex(d, TID, tid.p, 16) || end_str(d, TID) ||
           put_hex(d, SID, sid.p, 8) || end_str(d, SID) ||
           (size(psid) && !(size(psid) == 8 && is_zero(psid)) && put_hex(d, PSID, psid.p, size(psid))) ||
           end_str(d, PSID) || put_str(d, TSTATE, state.p, size(state)) || put_str(d, NAME, name.p, size(name)) ||
           put_str(d, SMSG, message.p, size(message)) || map_end_row(d, SA_OFF, first_attr) ||
           put_i32(d, EV_OFF, d->b[EV_TS].len / 8) || put_i32(d, LN_OFF, d->b[LN_STATE_OFF].len / 4 - 1);
}

static int scope_spans(decoder_t *d, reader_t r, int64_t resource) {
    int64_t scope = d->scopes++;
    reader_t empty = {r.p, r.p}, name = empty, version = empty, sub, s;
    while (r.p < r.end) {
        uint32_t f;
        int w;
        if (tag(d, &r, &f, &w)) return -1;
        if (f == 1 && w == LEN) { /* InstrumentationScope: name, version (its attributes are not stored) */
            if (bytes(d, &r, &sub)) return -1;
            while (sub.p < sub.end) {
                if (tag(d, &sub, &f, &w)) return -1;
                if ((f == 1 || f == 2) && w == LEN) {
                    if (string_field(d, &sub, &s)) return -1;
                    *(f == 1 ? &name : &version) = s;
                } else if (skip(d, &sub, f, w, 0)) {
                    return -1;
                }
            }
        } else if (f == 2 && w == LEN) {
            if (bytes(d, &r, &sub) || span(d, sub, scope)) return -1;
        } else if (f == 3 && w == LEN) {
            if (string_field(d, &r, &sub)) return -1;
        } else if (skip(d, &r, f, w, 0)) {
            return -1;
        }
    }
    return put_i32(d, SC_RES, resource) || put_str(d, SC_NAME, name.p, size(name)) ||
           put_str(d, SC_VERSION, version.p, size(version));
}

static int resource_spans(decoder_t *d, reader_t r) {
    int64_t resource = d->resources++, first = entries(d, RA_OFF);
    reader_t sub, attribute;
    while (r.p < r.end) {
        uint32_t f;
        int w;
        if (tag(d, &r, &f, &w)) return -1;
        if (f == 1 && w == LEN) { /* Resource: its attributes */
            if (bytes(d, &r, &sub)) return -1;
            while (sub.p < sub.end) {
                if (tag(d, &sub, &f, &w)) return -1;
                if (f == 1 && w == LEN) {
                    if (bytes(d, &sub, &attribute) || map_add(d, RA_OFF, attribute)) return -1;
                } else if (skip(d, &sub, f, w, 0)) {
                    return -1;
                }
            }
        } else if (f == 2 && w == LEN) {
            if (bytes(d, &r, &sub) || scope_spans(d, sub, resource)) return -1;
        } else if (f == 3 && w == LEN) {
            if (string_field(d, &r, &sub)) return -1;
        } else if (skip(d, &r, f, w, 0)) {
            return -1;
        }
    }
    if (map_end_row(d, RA_OFF, first)) return -1;
    const char *service = "";
    int64_t n = 0;
    map_get(d, RA_OFF, first, "service.name", &service, &n);
    return put_str(d, RSERVICE, (const uint8_t *)service, n);
}

/* --- the interface -------------------------------------------------------------------------------- */

const char *ss_buffer_names(void) { return BUFFER_NAMES; }

void ss_reset(decoder_t *d) {
    for (int i = 0; i < NBUF; i++) d->b[i].len = 0;
    d->rows = d->rejected = d->resources = d->scopes = 0;
    d->error[0] = 0;
    int zero_first[] = {TID_OFF, SID_OFF, PSID_OFF, TSTATE_OFF, NAME_OFF, SMSG_OFF, SA_OFF, SA_K_OFF, SA_V_OFF,
                        EV_OFF, EV_NAME_OFF, EA_OFF, EA_K_OFF, EA_V_OFF, LN_OFF, LN_TID_OFF, LN_SID_OFF,
                        LN_STATE_OFF, LA_OFF, LA_K_OFF, LA_V_OFF, RA_OFF, RA_K_OFF, RA_V_OFF, RSERVICE_OFF,
                        SC_NAME_OFF, SC_VERSION_OFF, RR_OFF, RR_K_OFF, RR_V_OFF};
    for (size_t k = 0; k < sizeof zero_first / sizeof *zero_first; k++) put_i32(d, zero_first[k], 0);
}

decoder_t *ss_new(void) {
    decoder_t *d = calloc(1, sizeof *d);
    if (d) ss_reset(d);
    return d;
}

void ss_free(decoder_t *d) {
    if (!d) return;
    for (int i = 0; i < NBUF; i++) free(d->b[i].p);
    free(d);
}

/* Hand buffer `i` over to the caller (who frees it); the decoder starts a new one. */
void *ss_detach(decoder_t *d, int i) {
    void *p = d->b[i].p;
    if (p && d->b[i].len && d->b[i].len < d->b[i].cap) { /* give back the unused tail of the last doubling */
        void *trimmed = realloc(p, (size_t)d->b[i].len);
        if (trimmed) p = trimmed;
    }
    d->b[i].p = NULL, d->b[i].len = d->b[i].cap = 0;
    return p;
}

/* Fill the per-row ResourceAttributes map (RR) from each row's scope's resource: a copy per row, which
   ClickHouse needs anyway, made here in one loop rather than by an Arrow `take`. */
int ss_resource_rows(decoder_t *d) {
    const int32_t *scope = (const int32_t *)d->b[SCOPE].p, *resource = (const int32_t *)d->b[SC_RES].p;
    for (int64_t row = 0; row < d->rows; row++) {
        const int32_t *rows = (const int32_t *)d->b[RA_OFF].p, *koff = (const int32_t *)d->b[RA_K_OFF].p,
                      *voff = (const int32_t *)d->b[RA_V_OFF].p;
        int32_t r = resource[scope[row]];
        for (int32_t e = rows[r]; e < rows[r + 1]; e++)
            if (put_str(d, RR_K, (const uint8_t *)d->b[RA_K].p + koff[e], koff[e + 1] - koff[e]) ||
                put_str(d, RR_V, (const uint8_t *)d->b[RA_V].p + voff[e], voff[e + 1] - voff[e]))
                return -1;
        if (put_i32(d, RR_OFF, entries(d, RR_OFF))) return -1;
    }
    return 0;
}

static int feed(decoder_t *d, const uint8_t *p, int64_t n);

/* Append the rows of one ExportTraceServiceRequest. 0 on success; -1 (buffers as before, d->error set)
   when the bytes are not a valid request. */
int ss_feed(decoder_t *d, const uint8_t *p, int64_t n) {
    d->check_only = 0;
    return feed(d, p, n);
}

/* What ss_feed would refuse, it refuses too, and it counts the rows it would keep and the spans it would
   reject, but it keeps nothing and formats no value: what the receiver needs before it acknowledges. */
int ss_check(decoder_t *d, const uint8_t *p, int64_t n, int64_t *rows, int64_t *rejected) {
    mark_t before;
    mark(d, &before);
    d->check_only = 1;
    int rc = feed(d, p, n);
    d->check_only = 0;
    *rows = d->rows - before.rows, *rejected = d->rejected - before.rejected;
    rollback(d, &before);
    return rc;
}

static int feed(decoder_t *d, const uint8_t *p, int64_t n) {
    mark_t before;
    mark(d, &before);
    d->error[0] = 0;
    reader_t r = {p, p + n}, sub;
    while (r.p < r.end) {
        uint32_t f;
        int w;
        if (tag(d, &r, &f, &w)) goto bad;
        if (f == 1 && w == LEN) {
            if (bytes(d, &r, &sub) || resource_spans(d, sub)) goto bad;
        } else if (skip(d, &r, f, w, 0)) {
            goto bad;
        }
    }
    return 0;
bad:
    if (!d->error[0]) fail(d, "malformed message");
    rollback(d, &before);
    return -1;
}
