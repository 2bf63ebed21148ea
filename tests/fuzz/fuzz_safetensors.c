// fuzz_safetensors.c: the safetensors reader: open (header, offsets, dtypes), every tensor
// read as fp32 where it can be, the header CRC, the metadata.
#include "src/io/safetensors.h"
#include "tests/fuzz/fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[1024] = "";
    const char *path = lb_fuzz_file(data, size, ".safetensors");
    lb_st_file f;
    int rc = lb_st_open(&f, path, err, sizeof err);
    if (rc != 0) {
        lb_fuzz_names(err, path);
        lb_fuzz_accepted = 0;
        return 0;
    }
    (void)lb_st_header_crc(&f, NULL);
    (void)lb_st_meta(&f, "format");
    for (int i = 0; i < f.ntensors && rc == 0; i++) {
        const lb_st_tensor *t = &f.tensors[i];
        if (lb_st_find(&f, t->name) != t) abort();   // names are unique and found
        int64_t n = lb_st_numel(t);
        if (strcmp(t->dtype, "F32") && strcmp(t->dtype, "BF16") && strcmp(t->dtype, "F16"))
            continue;
        float *out = malloc(sizeof(float) * (size_t)(n ? n : 1));   // n * size <= file size
        if (!out) abort();
        rc = lb_st_read_f32(&f, t, out, err, sizeof err);
        free(out);
    }
    if (rc != 0) lb_fuzz_names(err, path);
    lb_fuzz_accepted = rc == 0;
    lb_st_close(&f);
    return 0;
}
