// json.c: strict JSON reading (see json.h).
#include "src/io/json.h"

#include <stdio.h>
#include <string.h>

// The line (from first) of byte at of text.
static int line_of(const char *text, size_t at, int first)
{
    for (size_t i = 0; i < at; i++) first += text[i] == '\n';
    return first;
}

// The offset of the first \u0000 escape in a string of text (an odd run of backslashes before
// the u), or len when none.
static size_t escaped_nul(const char *text, size_t len)
{
    for (size_t i = 0; i + 6 <= len; i++) {
        if (text[i] != '\\' || text[i + 1] != 'u' || memcmp(text + i + 2, "0000", 4)) continue;
        size_t run = 0;
        while (run < i && text[i - 1 - run] == '\\') run++;
        if (run % 2 == 0) return i;
    }
    return len;
}

// The first key that an object of v (v itself or below it) holds twice, or NULL.
static const cJSON *duplicate_key(const cJSON *v)
{
    for (const cJSON *a = v ? v->child : NULL; a; a = a->next) {
        if (cJSON_IsObject(v))
            for (const cJSON *b = a->next; b; b = b->next)
                if (a->string && b->string && !strcmp(a->string, b->string)) return b;
        const cJSON *d = duplicate_key(a);
        if (d) return d;
    }
    return NULL;
}

// Where key stands as a key in text (`"key"` then a colon): the offset of its second
// appearance when it appears exactly twice (then that is the duplicate), else -1 (the line
// would be a guess).
static long key_at(const char *text, size_t len, const char *key)
{
    size_t k = strlen(key), seen = 0;
    long second = -1;
    for (size_t i = 0; i + k + 2 <= len; i++) {
        if (text[i] != '"' || memcmp(text + i + 1, key, k) || text[i + k + 1] != '"') continue;
        size_t j = i + k + 2;
        while (j < len && strchr(" \t\r\n", text[j])) j++;
        if (j < len && text[j] == ':' && ++seen == 2) second = (long)i;
    }
    return seen == 2 ? second : -1;
}

cJSON *lb_json_parse(const char *text, size_t len, const char *name, int first_line, char *err,
                     size_t errlen)
{
    const char *nul = memchr(text, 0, len);
    if (nul) {
        snprintf(err, errlen, "%s:%d: a NUL byte (offset %zu): not JSON text", name,
                 line_of(text, (size_t)(nul - text), first_line), (size_t)(nul - text));
        return NULL;
    }
    size_t esc = escaped_nul(text, len);
    if (esc < len) {
        snprintf(err, errlen, "%s:%d: a NUL character (\\u0000) in a string: it would end the "
                 "string here", name, line_of(text, esc, first_line));
        return NULL;
    }
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(text, len, &end, 0);
    if (!root) {
        const char *at = cJSON_GetErrorPtr();
        size_t off = at && at >= text && at <= text + len ? (size_t)(at - text) : 0;
        snprintf(err, errlen, "%s:%d: not valid JSON (near byte %zu)", name,
                 line_of(text, off, first_line), off);
        return NULL;
    }
    for (const char *p = end; p && p < text + len; p++)
        if (!strchr(" \t\r\n", *p)) {
            snprintf(err, errlen, "%s:%d: bytes after the JSON value (byte %zu)", name,
                     line_of(text, (size_t)(p - text), first_line), (size_t)(p - text));
            cJSON_Delete(root);
            return NULL;
        }
    const cJSON *dup = duplicate_key(root);
    if (dup) {
        long at = key_at(text, len, dup->string);
        char where[32] = "";
        if (at >= 0) snprintf(where, sizeof where, ":%d", line_of(text, (size_t)at, first_line));
        snprintf(err, errlen, "%s%s: key \"%s\" twice in one object (readers differ on which "
                 "one counts)", name, where, dup->string);
        cJSON_Delete(root);
        return NULL;
    }
    return root;
}
