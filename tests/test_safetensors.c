// test_safetensors.c: the safetensors reader and writer: round trips (F32, BF16 with exact
// rounding cases, metadata), a file written by Python's safetensors, every header error the
// reader must catch (each message naming the file), and saves that fail leaving no file.
#include <dirent.h>
#include <ftw.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "kernels/common.h"
#include "src/io/safetensors.h"
#include "tests/testutil.h"

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    return remove(p);
}

static void rm_rf(const char *dir)
{
    nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

static int dir_entries(const char *dir)
{
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
    closedir(d);
    return n;
}

static uint32_t bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

START_TEST(test_roundtrip_f32)
{
    char dir[256], path[512], err[512];
    snprintf(dir, sizeof dir, "%s", lb_test_tmpdir());
    snprintf(path, sizeof path, "%s/a.safetensors", dir);
    float m[6] = {1.0f, -2.0f, 3.5f, 1e-30f, -0.0f, 3.4e38f};
    float v[3] = {0.1f, 0.2f, 0.3f};
    float s = 42.0f;
    float t3[2 * 1 * 3] = {1, 2, 3, 4, 5, 6};
    int64_t sm[2] = {2, 3}, sv[1] = {3}, st3[3] = {2, 1, 3};
    lb_st_writer *w = lb_st_writer_new();
    lb_st_writer_add(w, "layer.weight", "F32", 2, sm, m);
    lb_st_writer_add(w, "vec", "F32", 1, sv, v);
    lb_st_writer_add(w, "scalar", "F32", 0, NULL, &s);
    lb_st_writer_add(w, "t3", "F32", 3, st3, t3);
    lb_st_writer_meta(w, "format", "pt");
    lb_st_writer_meta(w, "note", "quote \" and newline \n survive");
    lb_st_writer_meta(w, "format", "lowbit");      // a repeated key replaces the value
    ck_assert_int_eq(lb_st_writer_save(w, path, err, sizeof err), 0);
    lb_st_writer_free(w);
    ck_assert_int_eq(dir_entries(dir), 1);          // no temporary left behind

    lb_st_file f;
    ck_assert_msg(lb_st_open(&f, path, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(f.ntensors, 4);
    ck_assert_int_eq((int)(f.data_offset % 8), 0);
    ck_assert_uint_eq(f.file_size, f.data_offset + 4 * (6 + 3 + 1 + 6));
    ck_assert_str_eq(lb_st_meta(&f, "format"), "lowbit");
    ck_assert_str_eq(lb_st_meta(&f, "note"), "quote \" and newline \n survive");
    ck_assert_ptr_null(lb_st_meta(&f, "absent"));
    ck_assert_ptr_null(lb_st_find(&f, "absent"));
    const lb_st_tensor *t = lb_st_find(&f, "layer.weight");
    ck_assert_ptr_nonnull(t);
    ck_assert_str_eq(t->dtype, "F32");
    ck_assert_int_eq(t->ndim, 2);
    ck_assert_int_eq(t->shape[0], 2);
    ck_assert_int_eq(t->shape[1], 3);
    ck_assert_int_eq(lb_st_numel(t), 6);
    // Insertion order is the data order.
    ck_assert_uint_eq(t->begin, 0);
    ck_assert_uint_eq(lb_st_find(&f, "vec")->begin, 24);
    ck_assert_uint_eq(lb_st_find(&f, "scalar")->begin, 36);
    float out[6];
    ck_assert_int_eq(lb_st_read_f32(&f, t, out, err, sizeof err), 0);
    for (int i = 0; i < 6; i++) ck_assert_uint_eq(bits(out[i]), bits(m[i]));
    t = lb_st_find(&f, "scalar");
    ck_assert_int_eq(t->ndim, 0);
    ck_assert_int_eq(lb_st_numel(t), 1);
    ck_assert_int_eq(lb_st_read_f32(&f, t, out, err, sizeof err), 0);
    ck_assert_float_eq(out[0], 42.0f);
    t = lb_st_find(&f, "t3");
    ck_assert_int_eq(t->ndim, 3);
    ck_assert_int_eq(t->shape[2], 3);
    ck_assert_int_eq(lb_st_read_f32(&f, t, out, err, sizeof err), 0);
    for (int i = 0; i < 6; i++) ck_assert_float_eq(out[i], t3[i]);
    lb_st_close(&f);
    rm_rf(dir);
}
END_TEST

START_TEST(test_roundtrip_bf16)
{
    char dir[256], path[512], err[512];
    snprintf(dir, sizeof dir, "%s", lb_test_tmpdir());
    snprintf(path, sizeof path, "%s/b.safetensors", dir);
    // bf16 keeps 8 significant bits: 1 + 2^-8 is a tie between 1 and 1 + 2^-7 and goes to the
    // even one (1); 1 + 3*2^-8 is a tie going up to 1 + 2^-6; 1 + 2^-8 + 2^-20 is above the
    // tie and rounds up; a value below the tie rounds down.
    float x[6] = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 1.0f + 0x1p-8f + 0x1p-20f,
                  -(1.0f + 0x1p-9f), 3.0f, 0.0f};
    float want[6] = {1.0f, 1.0f + 0x1p-6f, 1.0f + 0x1p-7f, -1.0f, 3.0f, 0.0f};
    int64_t shape[2] = {3, 2};
    lb_st_writer *w = lb_st_writer_new();
    lb_st_writer_add(w, "w", "BF16", 2, shape, x);
    lb_st_writer_add(w, "w32", "F32", 2, shape, x);
    lb_st_writer_meta(w, "k", "v");
    ck_assert_int_eq(lb_st_writer_save(w, path, err, sizeof err), 0);
    lb_st_writer_free(w);

    lb_st_file f;
    ck_assert_msg(lb_st_open(&f, path, err, sizeof err) == 0, "%s", err);
    const lb_st_tensor *t = lb_st_find(&f, "w");
    ck_assert_str_eq(t->dtype, "BF16");
    ck_assert_uint_eq(t->end - t->begin, 12);
    ck_assert_uint_eq(f.file_size, f.data_offset + 12 + 24);
    ck_assert_str_eq(lb_st_meta(&f, "k"), "v");
    float out[6];
    ck_assert_int_eq(lb_st_read_f32(&f, t, out, err, sizeof err), 0);
    for (int i = 0; i < 6; i++)
        ck_assert_msg(out[i] == want[i], "element %d: %.9g, want %.9g", i, out[i], want[i]);
    ck_assert_int_eq(lb_st_read_f32(&f, lb_st_find(&f, "w32"), out, err, sizeof err), 0);
    for (int i = 0; i < 6; i++) ck_assert_uint_eq(bits(out[i]), bits(x[i]));
    lb_st_close(&f);
    rm_rf(dir);
}
END_TEST

// tests/data/st_python.safetensors is written by tests/tools/make_hf_golden.py with Python's
// safetensors: the same 2x4 values as F32, BF16 and F16, an I32 tensor and a 0-d scalar.
START_TEST(test_python_file)
{
    char err[512];
    const char *path = lb_test_src("tests/data/st_python.safetensors");
    lb_st_file f;
    ck_assert_msg(lb_st_open(&f, path, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(f.ntensors, 5);
    ck_assert_str_eq(lb_st_meta(&f, "source"), "make_hf_golden.py");
    const float x[8] = {1.0f, -2.5f, 3.14159265f, 1e-3f, 65504.0f, -0.0f, 1.0f / 3.0f, 7.0f};
    // The same values rounded by torch to bf16 and to f16.
    const float bf[8] = {1.0f, -2.5f, 3.140625f, 0.00099945068359375f, 65536.0f, -0.0f,
                         0.333984375f, 7.0f};
    const float hf[8] = {1.0f, -2.5f, 3.140625f, 0.0010004043579101562f, 65504.0f, -0.0f,
                         0.333251953125f, 7.0f};
    float out[8];
    const lb_st_tensor *t = lb_st_find(&f, "a.f32");
    ck_assert_int_eq(t->ndim, 2);
    ck_assert_int_eq(t->shape[0], 2);
    ck_assert_int_eq(t->shape[1], 4);
    ck_assert_int_eq(lb_st_read_f32(&f, t, out, err, sizeof err), 0);
    for (int i = 0; i < 8; i++) ck_assert_uint_eq(bits(out[i]), bits(x[i]));
    t = lb_st_find(&f, "b.bf16");
    ck_assert_str_eq(t->dtype, "BF16");
    ck_assert_int_eq(lb_st_read_f32(&f, t, out, err, sizeof err), 0);
    for (int i = 0; i < 8; i++) {
        ck_assert_uint_eq(bits(out[i]), bits(bf[i]));
        ck_assert_uint_eq(bits(out[i]), bits(lb_round_bf16(x[i])));   // same rounding as ours
    }
    t = lb_st_find(&f, "c.f16");
    ck_assert_str_eq(t->dtype, "F16");
    ck_assert_int_eq(lb_st_read_f32(&f, t, out, err, sizeof err), 0);
    for (int i = 0; i < 8; i++) ck_assert_uint_eq(bits(out[i]), bits(hf[i]));
    t = lb_st_find(&f, "e.scalar");
    ck_assert_int_eq(t->ndim, 0);
    ck_assert_int_eq(lb_st_read_f32(&f, t, out, err, sizeof err), 0);
    ck_assert_float_eq(out[0], 2.5f);
    // An integer tensor is listed but not converted.
    t = lb_st_find(&f, "d.i32");
    ck_assert_str_eq(t->dtype, "I32");
    ck_assert_int_eq(lb_st_numel(t), 6);
    ck_assert_int_eq(lb_st_read_f32(&f, t, out, err, sizeof err), -1);
    ck_assert_msg(strncmp(err, path, strlen(path)) == 0 && strstr(err, "'d.i32'") &&
                  strstr(err, "I32"), "%s", err);
    lb_st_close(&f);
}
END_TEST

// --- corrupt files -------------------------------------------------------------------------

// Writes an 8-byte length (*hlen, or the JSON's length when hlen is NULL), the JSON and
// ndata data bytes.
static void write_raw(const char *path, const uint64_t *hlen, const char *json, size_t ndata)
{
    FILE *fp = fopen(path, "wb");
    ck_assert_ptr_nonnull(fp);
    uint64_t n = hlen ? *hlen : strlen(json);
    unsigned char b[8];
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)(n >> (8 * i));
    fwrite(b, 1, 8, fp);
    fwrite(json, 1, strlen(json), fp);
    for (size_t i = 0; i < ndata; i++) fputc(0x3f, fp);
    fclose(fp);
}

// Opens a crafted file and expects failure with "PATH: ..." containing `want`.
static void expect_bad(const char *dir, const char *json, size_t ndata, const char *want)
{
    static int k;
    char path[512], err[512];
    snprintf(path, sizeof path, "%s/bad%d.safetensors", dir, k++);
    write_raw(path, NULL, json, ndata);
    lb_st_file f;
    memset(err, 0, sizeof err);
    int rc = lb_st_open(&f, path, err, sizeof err);
    ck_assert_msg(rc == -1, "%s opened: %s", json, path);
    ck_assert_msg(strncmp(err, path, strlen(path)) == 0 && err[strlen(path)] == ':',
                  "message does not start with the file: %s", err);
    ck_assert_msg(strstr(err, want) != NULL, "header %s: got '%s', want '%s'", json, err, want);
    ck_assert_msg(strchr(err, '\n') == NULL, "message is not one line: %s", err);
}

START_TEST(test_short_and_length)
{
    char dir[256], path[512], err[512];
    snprintf(dir, sizeof dir, "%s", lb_test_tmpdir());
    lb_st_file f;
    // Shorter than the 8-byte length field.
    snprintf(path, sizeof path, "%s/short.safetensors", dir);
    FILE *fp = fopen(path, "wb");
    fwrite("\x02\0\0\0\0", 1, 5, fp);
    fclose(fp);
    ck_assert_int_eq(lb_st_open(&f, path, err, sizeof err), -1);
    ck_assert_msg(strncmp(err, path, strlen(path)) == 0 && strstr(err, "too short"), "%s", err);
    // Empty file.
    fp = fopen(path, "wb");
    fclose(fp);
    ck_assert_int_eq(lb_st_open(&f, path, err, sizeof err), -1);
    ck_assert_msg(strncmp(err, path, strlen(path)) == 0 && strstr(err, "too short"), "%s", err);
    // Header length beyond the end of the file.
    snprintf(path, sizeof path, "%s/long.safetensors", dir);
    uint64_t hlen = 1000;
    write_raw(path, &hlen, "{}", 0);
    ck_assert_int_eq(lb_st_open(&f, path, err, sizeof err), -1);
    ck_assert_msg(strncmp(err, path, strlen(path)) == 0 && strstr(err, "header length 1000"),
                  "%s", err);
    // A length near 2^64 must not wrap around.
    hlen = UINT64_MAX - 2;
    write_raw(path, &hlen, "{}", 0);
    ck_assert_int_eq(lb_st_open(&f, path, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "runs past the end"), "%s", err);
    // Missing file.
    snprintf(path, sizeof path, "%s/none.safetensors", dir);
    ck_assert_int_eq(lb_st_open(&f, path, err, sizeof err), -1);
    ck_assert_msg(strncmp(err, path, strlen(path)) == 0, "%s", err);
    rm_rf(dir);
}
END_TEST

START_TEST(test_bad_headers)
{
    char dir[256];
    snprintf(dir, sizeof dir, "%s", lb_test_tmpdir());
    const char *ok = "\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]";
    char json[512];
    expect_bad(dir, "{\"a\": {\"dtype\":", 0, "not valid JSON");
    expect_bad(dir, "[1, 2]", 0, "not a JSON object");
    expect_bad(dir, "{} x", 0, "bytes after the JSON");
    expect_bad(dir, "{\"a\": 5}", 0, "not a JSON object");
    expect_bad(dir, "{\"a\":{\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "missing dtype");
    expect_bad(dir, "{\"a\":{\"dtype\":\"F33\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8,
               "unknown dtype 'F33'");
    expect_bad(dir, "{\"a\":{\"dtype\":4,\"shape\":[2],\"data_offsets\":[0,8]}}", 8,
               "dtype is not a string");
    expect_bad(dir, "{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,8]}}", 8, "missing shape");
    expect_bad(dir, "{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8,
               "non-negative integers");
    expect_bad(dir, "{\"a\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,8]}}", 8,
               "non-negative integers");
    expect_bad(dir, "{\"a\":{\"dtype\":\"F32\",\"shape\":\"2\",\"data_offsets\":[0,8]}}", 8,
               "shape must be an array");
    expect_bad(dir, "{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,2],"
               "\"data_offsets\":[0,8]}}", 8, "at most 8");
    expect_bad(dir, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, "missing data_offsets");
    expect_bad(dir, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 8,
               "data_offsets must be [begin, end]");
    expect_bad(dir, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8,
               "data_offsets must be [begin, end]");
    expect_bad(dir, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,\"8\"]}}", 8,
               "data_offsets must be [begin, end]");
    // Offsets beyond the data section (the file holds 4 data bytes).
    expect_bad(dir, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 4,
               "outside the data section");
    // Byte count disagreeing with shape x dtype size.
    expect_bad(dir, "{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8,
               "need 12");
    expect_bad(dir, "{\"a\":{\"dtype\":\"BF16\",\"shape\":[2,2],\"data_offsets\":[0,4]}}", 4,
               "need 8");
    // Overlap: b starts inside a.
    expect_bad(dir, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
               "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12,
               "overlap tensor 'a'");
    // Two tensors on the same bytes.
    expect_bad(dir, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
               "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "overlap");
    // A hole between tensors, and data past the last tensor.
    expect_bad(dir, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
               "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]}}", 20,
               "gap of 4 bytes");
    snprintf(json, sizeof json, "{\"a\":{%s}}", ok);
    expect_bad(dir, json, 12, "cover 8 bytes of the 12-byte");
    // The same name twice.
    expect_bad(dir, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
               "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}", 16,
               "'a' appears twice");
    // Metadata must be string pairs.
    snprintf(json, sizeof json, "{\"__metadata__\":{\"n\":3},\"a\":{%s}}", ok);
    expect_bad(dir, json, 8, "value of 'n' is not a string");
    snprintf(json, sizeof json, "{\"__metadata__\":[],\"a\":{%s}}", ok);
    expect_bad(dir, json, 8, "__metadata__ is not a JSON object");

    // Control: the well-formed version of these files opens, with space padding after the JSON.
    char path[512], err[512];
    snprintf(path, sizeof path, "%s/good.safetensors", dir);
    snprintf(json, sizeof json, "{\"__metadata__\":{\"n\":\"3\"},\"a\":{%s}}      ", ok);
    write_raw(path, NULL, json, 8);
    lb_st_file f;
    ck_assert_msg(lb_st_open(&f, path, err, sizeof err) == 0, "%s", err);
    ck_assert_str_eq(lb_st_meta(&f, "n"), "3");
    ck_assert_uint_eq(f.data_offset, 8 + strlen(json));
    lb_st_close(&f);
    rm_rf(dir);
}
END_TEST

START_TEST(test_failed_save_leaves_no_file)
{
    char dir[256], path[512], err[512];
    snprintf(dir, sizeof dir, "%s", lb_test_tmpdir());
    float x[2] = {1, 2};
    int64_t shape[1] = {2};
    // A dtype the writer cannot produce.
    snprintf(path, sizeof path, "%s/x.safetensors", dir);
    lb_st_writer *w = lb_st_writer_new();
    lb_st_writer_add(w, "a", "F32", 1, shape, x);
    lb_st_writer_add(w, "b", "F16", 1, shape, x);
    ck_assert_int_eq(lb_st_writer_save(w, path, err, sizeof err), -1);
    ck_assert_msg(strncmp(err, path, strlen(path)) == 0 && strstr(err, "'F16'"), "%s", err);
    lb_st_writer_free(w);
    ck_assert_int_eq(dir_entries(dir), 0);
    // The same name twice.
    w = lb_st_writer_new();
    lb_st_writer_add(w, "a", "F32", 1, shape, x);
    lb_st_writer_add(w, "b", "F32", 1, shape, x);
    lb_st_writer_add(w, "a", "BF16", 1, shape, x);
    ck_assert_int_eq(lb_st_writer_save(w, path, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "'a' added twice"), "%s", err);
    lb_st_writer_free(w);
    ck_assert_int_eq(dir_entries(dir), 0);
    // A directory that does not exist.
    snprintf(path, sizeof path, "%s/missing/x.safetensors", dir);
    w = lb_st_writer_new();
    lb_st_writer_add(w, "a", "F32", 1, shape, x);
    ck_assert_int_eq(lb_st_writer_save(w, path, err, sizeof err), -1);
    lb_st_writer_free(w);
    ck_assert_int_eq(dir_entries(dir), 0);
    // An existing file survives a failed save over it.
    snprintf(path, sizeof path, "%s/keep.safetensors", dir);
    w = lb_st_writer_new();
    lb_st_writer_add(w, "a", "F32", 1, shape, x);
    ck_assert_int_eq(lb_st_writer_save(w, path, err, sizeof err), 0);
    lb_st_writer_free(w);
    w = lb_st_writer_new();
    lb_st_writer_add(w, "z", "I8", 1, shape, x);
    ck_assert_int_eq(lb_st_writer_save(w, path, err, sizeof err), -1);
    lb_st_writer_free(w);
    ck_assert_int_eq(dir_entries(dir), 1);
    lb_st_file f;
    ck_assert_msg(lb_st_open(&f, path, err, sizeof err) == 0, "%s", err);
    ck_assert_ptr_nonnull(lb_st_find(&f, "a"));
    lb_st_close(&f);
    rm_rf(dir);
}
END_TEST

// An empty writer gives a valid file with no tensors, which the reader opens.
START_TEST(test_empty)
{
    char dir[256], path[512], err[512];
    snprintf(dir, sizeof dir, "%s", lb_test_tmpdir());
    snprintf(path, sizeof path, "%s/e.safetensors", dir);
    lb_st_writer *w = lb_st_writer_new();
    ck_assert_int_eq(lb_st_writer_save(w, path, err, sizeof err), 0);
    lb_st_writer_free(w);
    lb_st_file f;
    ck_assert_msg(lb_st_open(&f, path, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(f.ntensors, 0);
    ck_assert_int_eq(f.nmeta, 0);
    ck_assert_uint_eq(f.file_size, f.data_offset);
    lb_st_close(&f);
    rm_rf(dir);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("safetensors");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, test_roundtrip_f32);
    tcase_add_test(tc, test_roundtrip_bf16);
    tcase_add_test(tc, test_python_file);
    tcase_add_test(tc, test_short_and_length);
    tcase_add_test(tc, test_bad_headers);
    tcase_add_test(tc, test_failed_save_leaves_no_file);
    tcase_add_test(tc, test_empty);
    suite_add_tcase(s, tc);
    return lb_test_run(s);
}
