// safetensors.h: reader and writer for the safetensors format (8-byte little-endian header
// length, a JSON header, then the raw data). Used for Hugging Face import/export and for
// lowbit's own checkpoints.
#ifndef LB_SAFETENSORS_H
#define LB_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    char name[160];
    char dtype[8];                 // "F32", "BF16", "F16", "I32", ...
    int ndim;
    int64_t shape[8];
    size_t begin, end;             // byte range inside the data section
} lb_st_tensor;

typedef struct {
    char path[512];
    int ntensors;
    lb_st_tensor *tensors;
    int nmeta;
    char **meta_keys, **meta_values; // "__metadata__" string pairs
    size_t data_offset;            // file offset of the data section
    size_t file_size;
    void *fp;                      // FILE *
} lb_st_file;

// Opens and validates the header (sizes, offsets inside the file, known dtypes).
// Returns 0, or -1 with "path: problem" in err.
int lb_st_open(lb_st_file *f, const char *path, char *err, size_t errlen);
void lb_st_close(lb_st_file *f);
const lb_st_tensor *lb_st_find(const lb_st_file *f, const char *name);
const char *lb_st_meta(const lb_st_file *f, const char *key);   // NULL when absent
// Reads a tensor converted to fp32 (F32, BF16, F16). -1 with "path: tensor 'x': problem".
int lb_st_read_f32(const lb_st_file *f, const lb_st_tensor *t, float *out, char *err,
                   size_t errlen);
int64_t lb_st_numel(const lb_st_tensor *t);

// CRC-32 (IEEE, zlib's) of n bytes continued from crc (0 to start).
uint32_t lb_st_crc32(uint32_t crc, const void *data, size_t n);
// A CRC-32 of the header as parsed: every metadata pair but skip_key (sorted by key), then
// every tensor's name, dtype, shape and data offsets (sorted by name). Spacing, key order and
// padding do not change it; any change of a value, a name, a shape or an offset does. The
// writer's lb_st_writer_header_crc gives the same number for the header it will write.
uint32_t lb_st_header_crc(const lb_st_file *f, const char *skip_key);

// Writer: collect tensors (the data pointers must stay valid until save), then save
// atomically (temporary name, fsync, rename, fsync of the directory).
typedef struct lb_st_writer lb_st_writer;
lb_st_writer *lb_st_writer_new(void);
// dtype "F32" stores data as is; "BF16" rounds fp32 data to nearest even.
void lb_st_writer_add(lb_st_writer *w, const char *name, const char *dtype, int ndim,
                      const int64_t *shape, const float *data);
void lb_st_writer_meta(lb_st_writer *w, const char *key, const char *value);
int lb_st_writer_save(lb_st_writer *w, const char *path, char *err, size_t errlen);
// lb_st_header_crc of the file save would write now (its metadata so far, but skip_key).
uint32_t lb_st_writer_header_crc(const lb_st_writer *w, const char *skip_key);
void lb_st_writer_free(lb_st_writer *w);

#endif
