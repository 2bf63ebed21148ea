// fuzz_config.c: the parameter-file parser (lb_text_check, lb_config_parse, then
// lb_config_validate), as main.c reads a FILE.cfg.
#include "src/cli/config.h"
#include "src/io/files.h"
#include "tests/fuzz/fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[1024] = "";
    char *text = malloc(size + 1);
    if (!text) abort();
    memcpy(text, data, size);
    text[size] = 0;
    lb_config c;
    lb_config_defaults(&c);
    int rc = lb_text_check(text, size, "fuzz.cfg", err, sizeof err);
    if (rc == 0) rc = lb_config_parse(&c, text, "fuzz.cfg", err, sizeof err);
    if (rc != 0) lb_fuzz_names(err, "fuzz.cfg");
    if (rc == 0) rc = lb_config_validate(&c, err, sizeof err);   // names keys, not the file
    if (rc == 0) free(lb_config_to_ini(&c));
    lb_fuzz_accepted = rc == 0;
    free(text);
    return 0;
}
