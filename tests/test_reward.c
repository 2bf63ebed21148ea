// test_reward.c: the built-in rewards for prompts with reference answers (final number or
// \boxed{} against the answer, a regex, a format bonus) on the cases that trip answer
// checkers, the reward command (batches, several at once, a time limit, its failures), and the
// JSON-lines prompt sets (their mistakes, split, draw order, chat template).
#include <math.h>
#include <time.h>
#include <unistd.h>
#include "src/rl/prompts.h"
#include "src/rl/reward.h"
#include "tests/testutil.h"

// (completion, reference, 1 when they match)
static const struct {
    const char *completion, *answer;
    int match;
} answer_cases[] = {
    // several numbers: the last one counts
    {"3 apples and 4 pears make 7", "7", 1},
    {"The answer is 7. Check: 3+4", "7", 0},
    {"#### 42\n", "42", 1},
    // signs: a '-' after a digit or letter is an operator, not a sign
    {"x = -3", "-3", 1},
    {"x = -3", "3", 0},
    {"10-3=7", "7", 1},
    {"5-3", "3", 1},
    {"5-3", "-3", 0},
    {"it is \xe2\x88\x92" "4", "-4", 1},   // U+2212 minus
    {"(-2)", "-2", 1},
    {"+5", "5", 1},
    // thousands and trailing zeros
    {"It costs 1,000 dollars", "1000", 1},
    {"1000", "1,000", 1},
    {"1,234,567", "1234567", 1},
    {"the list 1,2,3", "3", 1},            // not a thousands group
    {"3.50", "3.5", 1},
    {"3.0", "3", 1},
    {"3.05", "3.5", 0},
    {"it is .5", "0.5", 1},
    // fractions: equal as exact rationals
    {"1/2", "0.5", 1},
    {"0.50", "1/2", 1},
    {"2/4", "1/2", 1},
    {"\\frac{1}{2}", "0.5", 1},
    {"-\\dfrac{3}{4}", "-0.75", 1},
    {"0.333", "1/3", 0},
    {"1/0", "1", 0},                      // no fraction: the last number is 0
    // units and currency
    {"She pays $5.", "5", 1},
    {"5 cm", "5", 1},
    {"5", "5 cm", 1},
    {"5", "$5", 1},
    {"50%", "50", 1},
    {"50", "50\\%", 1},
    {"no number here", "5", 0},
    {"", "5", 0},
    // \boxed{}: the last complete one, nested braces kept, over any later number
    {"so \\boxed{12} from 3 and 4", "12", 1},
    {"\\boxed{1} then \\boxed{2}", "2", 1},
    {"\\boxed{\\frac{1}{2}}", "1/2", 1},
    {"\\boxed{\\frac{\\pi}{2}}", "\\frac{\\pi}{2}", 1},
    {"\\boxed{ x^2 + 1 }", "x^2+1", 1},
    {"\\boxed{\\dfrac{\\pi}{2}}", "\\frac{\\pi}{2}", 1},
    {"\\boxed{x^2+2}", "x^2+1", 0},
    {"\\boxed{5 apples and 6}", "6", 0},  // a boxed text is not one number
    {"\\boxed{12", "12", 1},                // unclosed: ignored, the last number
    {"\\boxed{1,000}", "\\boxed{1000}", 1}, // a reference written boxed
    {"7", "x+1", 0},                       // a text answer needs a \boxed{}
    // beyond 18 digits numbers are not compared
    {"1234567890123456789", "1234567890123456789", 0},
};

START_TEST(test_answer_match)
{
    for (size_t i = 0; i < sizeof answer_cases / sizeof answer_cases[0]; i++) {
        const char *c = answer_cases[i].completion;
        ck_assert_msg(lb_answer_match(c, strlen(c), answer_cases[i].answer) ==
                          answer_cases[i].match,
                      "'%s' against '%s': want %d", c, answer_cases[i].answer,
                      answer_cases[i].match);
    }
    char out[64];
    ck_assert_int_eq(lb_answer_final("a 1 b \\boxed{x{y}} c 2", 22, out, sizeof out), 0);
    ck_assert_str_eq(out, "x{y}");
    ck_assert_int_eq(lb_answer_final("a -1,000.5 b", 12, out, sizeof out), 0);
    ck_assert_str_eq(out, "-1,000.5");
    ck_assert_int_eq(lb_answer_final("none", 4, out, sizeof out), -1);
}
END_TEST

static double score(const lb_rewards *r, const char *answer, const char *completion,
                    int stopped)
{
    char err[512];
    double v = -1;
    lb_reward_item it = {"Q", answer, completion, strlen(completion), stopped};
    ck_assert_msg(lb_rewards_score(r, &it, 1, &v, err, sizeof err) == 0, "%s", err);
    return v;
}

START_TEST(test_builtin_rewards)
{
    char err[512];
    lb_rewards r;
    lb_rewards_config c = {0.25, "", {NULL, 1, 1, 0, 0}};
    ck_assert_int_eq(lb_rewards_init(&r, "answer_exact,answer_format", &c, err, sizeof err), 0);
    ck_assert(lb_rewards_need_answer(&r));
    ck_assert(score(&r, "42", "so 42\n", 1) == 1.25);
    ck_assert(score(&r, "42", "so 42", 0) == 1.0);     // cut by the length limit: no bonus
    ck_assert(score(&r, "42", "so 41\n", 1) == 0.25);
    ck_assert(score(&r, "42", "no idea\n", 1) == 0.0);  // no final answer: no bonus
    ck_assert(score(&r, "", "42\n", 1) == 0.25);        // no reference: format only
    lb_rewards_free(&r);
    // a regex, fixed or with the reference in it (literally: "1.5" does not match "105")
    c.regex = "^[0-9]+\\n$";
    ck_assert_int_eq(lb_rewards_init(&r, "answer_regex", &c, err, sizeof err), 0);
    ck_assert(!lb_rewards_need_answer(&r));
    ck_assert(score(&r, "", "17\n", 1) == 1.0);
    ck_assert(score(&r, "", "17 \n", 1) == 0.0);
    lb_rewards_free(&r);
    c.regex = "answer: {answer}$";
    ck_assert_int_eq(lb_rewards_init(&r, "answer_regex", &c, err, sizeof err), 0);
    ck_assert(score(&r, "1.5", "answer: 1.5", 0) == 1.0);
    ck_assert(score(&r, "1.5", "answer: 105", 0) == 0.0);
    ck_assert(score(&r, "a\\Eb", "answer: a\\Eb", 0) == 1.0);
    lb_rewards_free(&r);
    c.regex = "([0-9]";
    ck_assert_int_eq(lb_rewards_init(&r, "answer_regex", &c, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "rl.reward_regex: '([0-9]' at offset"), "%s", err);
    c.regex = "";
    ck_assert_int_eq(lb_rewards_init(&r, "answer_regex", &c, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "rl.reward_regex is empty"), "%s", err);
}
END_TEST

// ---- the reward command ------------------------------------------------------------------------

static lb_reward_item items[8];
static char texts[8][32];

static void make_items(void)
{
    for (int i = 0; i < 8; i++) {
        snprintf(texts[i], sizeof texts[i], "%d\n", i * 10);
        items[i] = (lb_reward_item){i == 3 ? "say \"hi\"\n" : "p", "7", texts[i],
                                    strlen(texts[i]), 1};
    }
}

START_TEST(test_reward_command_batches)
{
    char err[1024], cmd[1024], path[600];
    const char *dir = lb_test_tmpdir();
    double v[8];
    make_items();
    // each run appends its input to a log and its pid to another, and answers each line with
    // the completion's number halved (read from the JSON line)
    snprintf(cmd, sizeof cmd, "tee -a '%s/in' | sed 's/.*\"completion\": \"\\([0-9]*\\).*/\\1/' "
             "| awk '{ print $1 / 2 }'; echo $$ >> '%s/pids'", dir, dir);
    lb_reward_cmd c = {cmd, 3, 2, 10, 0};
    int late = -1;
    ck_assert_msg(lb_reward_command_run(&c, items, 8, v, &late, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(late, 0);
    for (int i = 0; i < 8; i++) ck_assert_msg(v[i] == i * 5.0, "item %d: %g", i, v[i]);
    snprintf(path, sizeof path, "%s/pids", dir);   // 8 completions in batches of 3: 3 runs
    FILE *f = fopen(path, "r");
    ck_assert_ptr_nonnull(f);
    int runs = 0;
    char line[512];
    while (fgets(line, sizeof line, f)) runs++;
    fclose(f);
    ck_assert_int_eq(runs, 3);
    snprintf(path, sizeof path, "%s/in", dir);     // the protocol, escapes included
    f = fopen(path, "r");
    ck_assert_ptr_nonnull(f);
    int found = 0;
    while (fgets(line, sizeof line, f))
        found += !strcmp(line, "{\"prompt\": \"say \\\"hi\\\"\\n\", \"completion\": \"30\\n\", "
                               "\"answer\": \"7\"}\n");
    fclose(f);
    ck_assert_int_eq(found, 1);
    // several at once: 4 runs of a batch of 2, each sleeping 0.5 s, take well under 4 x 0.5 s
    lb_reward_cmd par = {"sleep 0.5; awk '{ print 1 }'", 2, 4, 10, 0};
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    ck_assert_msg(lb_reward_command_run(&par, items, 8, v, NULL, err, sizeof err) == 0, "%s", err);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double dt = (double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
    ck_assert_msg(dt < 1.5, "4 runs at once took %.2f s", dt);
    for (int i = 0; i < 8; i++) ck_assert(v[i] == 1.0);
    // the rewards' sum with the built-in functions
    lb_rewards r;
    lb_rewards_config rc = {0.1, "", {"awk '{ print -0.25 }'", 4, 2, 10, 0}};
    ck_assert_int_eq(lb_rewards_init(&r, "answer_exact", &rc, err, sizeof err), 0);
    lb_reward_item one = {"p", "70", texts[7], strlen(texts[7]), 1};
    ck_assert_int_eq(lb_rewards_score(&r, &one, 1, v, err, sizeof err), 0);
    ck_assert(v[0] == 0.75);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    ck_assert(system(cmd) == 0);
}
END_TEST

START_TEST(test_reward_command_timeout)
{
    char err[1024];
    double v[8];
    make_items();
    // the batch holding item 3 ("hi") hangs: killed after 0.3 s with its children, its two
    // completions get -1, the others their numbers
    lb_reward_cmd c = {"in=$(cat); case \"$in\" in *hi*) sleep 30;; esac; "
                       "printf '%s\\n' \"$in\" | awk '{ print 2 }'", 2, 3, 0.3, -1};
    int late = 0;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    ck_assert_msg(lb_reward_command_run(&c, items, 8, v, &late, err, sizeof err) == 0, "%s", err);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double dt = (double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
    ck_assert_msg(dt < 5, "the timed-out run held us %.2f s", dt);
    ck_assert_int_eq(late, 2);
    for (int i = 0; i < 8; i++) ck_assert_msg(v[i] == (i / 2 == 1 ? -1.0 : 2.0), "%d: %g", i, v[i]);
    // the check before any work: a command that gives no answer in time is refused
    lb_rewards r;
    lb_rewards_config rc = {0.1, "", {"sleep 30", 1, 1, 0.2, 0}};
    ck_assert_int_eq(lb_rewards_init(&r, "", &rc, err, sizeof err), 0);
    ck_assert_int_eq(lb_rewards_check(&r, &items[0], err, sizeof err), -1);
    ck_assert_msg(strstr(err, "gave no answer to a test line within rl.reward_timeout (0.2 s)"),
                  "%s", err);
}
END_TEST

START_TEST(test_reward_command_failures)
{
    char err[1024];
    double v[8];
    make_items();
    lb_reward_cmd c = {"exit 3", 1, 2, 10, 0};
    ck_assert_int_eq(lb_reward_command_run(&c, items + 3, 1, v, NULL, err, sizeof err), -1);
    ck_assert_str_eq(err, "rl.reward_command: 'exit 3' exited with status 3 on a batch of 1 "
                          "(prompt 'say \"hi\"?', completion '30?')");
    c.command = "echo abc";
    ck_assert_int_eq(lb_reward_command_run(&c, items, 1, v, NULL, err, sizeof err), -1);
    ck_assert_str_eq(err, "rl.reward_command: 'echo abc' printed 'abc' on line 1 of a batch of "
                          "1, not one number (prompt 'p', completion '0?')");
    // (command, completions in its one batch, what the message says)
    static const struct {
        const char *command;
        int n;
        const char *want;
    } bad[] = {
        {"echo 1 2", 1, "printed '1 2' on line 1"},
        {"true", 1, "printed 0 line(s) for a batch of 1"},
        {"echo nan", 1, "printed 'nan' on line 1"},
        {"kill -9 $$", 1, "killed by signal 9"},
        {"printf '1\\n2\\n'", 3, "printed 2 line(s) for a batch of 3"},   // too few lines
        {"printf '1\\n2\\n3\\n4\\n'", 3, "printed more than 3 line(s)"},   // too many
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        lb_reward_cmd b = {bad[i].command, 3, 2, 10, 0};
        ck_assert_int_eq(lb_reward_command_run(&b, items, bad[i].n, v, NULL, err, sizeof err), -1);
        ck_assert_msg(strstr(err, bad[i].want), "'%s': %s", bad[i].command, err);
    }
    c.batch = 3;
    // a command that exits without reading its input: its status, not a SIGPIPE of ours
    c.command = "echo 1; echo 2; echo 3";
    ck_assert_int_eq(lb_reward_command_run(&c, items, 3, v, NULL, err, sizeof err), 0);
    ck_assert(v[0] == 1 && v[1] == 2 && v[2] == 3);
    // refused before any work: not there, and answering its test line wrong
    lb_rewards r;
    lb_rewards_config rc = {0.1, "", {"/nonexistent/reward", 1, 1, 10, 0}};
    ck_assert_int_eq(lb_rewards_init(&r, "", &rc, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "'/nonexistent/reward' is not a command sh can run"), "%s", err);
    rc.cmd.command = "echo yes";
    ck_assert_int_eq(lb_rewards_init(&r, "", &rc, err, sizeof err), 0);
    ck_assert_int_eq(lb_rewards_check(&r, &items[0], err, sizeof err), -1);
    ck_assert_msg(strstr(err, "printed 'yes' on line 1"), "%s", err);
    rc.cmd.command = "cat > /dev/null; echo 0.5";
    ck_assert_int_eq(lb_rewards_init(&r, "", &rc, err, sizeof err), 0);
    ck_assert_int_eq(lb_rewards_check(&r, &items[0], err, sizeof err), 0);
}
END_TEST

// ---- prompt sets -------------------------------------------------------------------------------

static const char *write_file(const char *dir, const char *name, const char *text, size_t n)
{
    static char path[8][600];
    static int next;
    char *p = path[next++ % 8];
    snprintf(p, sizeof path[0], "%s/%s", dir, name);
    FILE *f = fopen(p, "wb");
    ck_assert_ptr_nonnull(f);
    ck_assert(fwrite(text, 1, n, f) == n);
    fclose(f);
    return p;
}

static void expect_bad(const char *dir, const char *text, size_t n, const char *want)
{
    char err[1024], expect[800];
    lb_prompt_set s;
    const char *p = write_file(dir, "bad.jsonl", text, n ? n : strlen(text));
    ck_assert_int_eq(lb_prompts_read(p, "prompt", "answer", &s, err, sizeof err), -1);
    snprintf(expect, sizeof expect, "%s:%s", p, want);
    ck_assert_msg(strstr(err, expect), "got '%s', want '%s'", err, expect);
}

START_TEST(test_prompt_sets)
{
    char err[1024];
    const char *dir = lb_test_tmpdir();
    const char good[] = "{\"prompt\": \"2+2=\", \"answer\": \"4\"}\n\n"
                        "{\"answer\": 0.5, \"prompt\": \"half?\", \"extra\": [1]}\r\n"
                        "  \n{\"prompt\": \"big\", \"answer\": 1000}";
    lb_prompt_set s;
    const char *p = write_file(dir, "p.jsonl", good, sizeof good - 1);
    ck_assert_msg(lb_prompts_read(p, "prompt", "answer", &s, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(s.n, 3);
    ck_assert_str_eq(s.p[1].prompt, "half?");
    ck_assert_str_eq(s.p[1].answer, "0.5");
    ck_assert_str_eq(s.p[2].answer, "1000");
    ck_assert_int_eq(s.p[2].line, 5);
    lb_prompts_free(&s);
    // other keys
    const char q[] = "{\"question\": \"q\", \"final\": \"7\"}\n";
    p = write_file(dir, "q.jsonl", q, sizeof q - 1);
    ck_assert_int_eq(lb_prompts_read(p, "question", "final", &s, err, sizeof err), 0);
    ck_assert_str_eq(s.p[0].answer, "7");
    lb_prompts_free(&s);
    // mistakes, with file:line
    expect_bad(dir, "{\"prompt\": \"a\", \"answer\": \"1\"}\n{\"prompt\": \"b\"}\n", 0,
               "2: no \"answer\" as a string or a number");
    expect_bad(dir, "{\"prompt\": 3, \"answer\": \"1\"}\n", 0, "1: no string \"prompt\"");
    expect_bad(dir, "{\"prompt\": \"\", \"answer\": \"1\"}\n", 0, "1: \"prompt\" is empty");
    expect_bad(dir, "[1]\n", 0, "1: not a JSON object");
    expect_bad(dir, "\n{\"prompt\": \"a\", \"prompt\": \"b\", \"answer\": 1}\n", 0, "2:");
    expect_bad(dir, "{\"prompt\": \"a\", \"answer\": 1} x\n", 0, "1:");
    expect_bad(dir, "{\"prompt\": \"a\\u0000\", \"answer\": 1}\n", 0, "1:");
    static const char nul[] = "{\"prompt\": \"a\", \"answer\": 1}\n{\"prompt\": \"\0\"}\n";
    expect_bad(dir, nul, sizeof nul - 1, "2:");
    char e2[1024];
    p = write_file(dir, "empty.jsonl", "\n \n", 3);
    ck_assert_int_eq(lb_prompts_read(p, "prompt", "answer", &s, e2, sizeof e2), -1);
    ck_assert_msg(strstr(e2, "no prompts"), "%s", e2);

    // the split: a fraction held out by the seed, file order kept, the rest to train
    char many[100 * 48];
    size_t o = 0;
    for (int i = 0; i < 100; i++)
        o += (size_t)snprintf(many + o, sizeof many - o, "{\"prompt\": \"p%d\", \"answer\": %d}\n",
                              i, i);
    p = write_file(dir, "many.jsonl", many, o);
    lb_prompt_set all, tr, va, tr2, va2;
    ck_assert_int_eq(lb_prompts_read(p, "prompt", "answer", &all, err, sizeof err), 0);
    ck_assert_int_eq(lb_prompts_split(&all, 0.1, 7, &tr, &va, err, sizeof err), 0);
    ck_assert_int_eq(va.n, 10);
    ck_assert_int_eq(tr.n, 90);
    for (int i = 1; i < va.n; i++) ck_assert(va.p[i].line > va.p[i - 1].line);
    ck_assert_int_eq(lb_prompts_split(&all, 0.1, 8, &tr2, &va2, err, sizeof err), 0);
    int same = 0;
    for (int i = 0; i < 10; i++) same += va.p[i].line == va2.p[i].line;
    ck_assert_int_lt(same, 10);   // another seed, other held-out prompts
    free(tr2.p), free(va2.p);
    ck_assert_int_eq(lb_prompts_split(&all, 0.9, 7, &tr2, &va2, err, sizeof err), 0);
    ck_assert_int_eq(tr2.n, 10);
    free(tr2.p), free(va2.p);
    // the order: every prompt once per pass, passes differ, a pure function of (seed, i)
    lb_prompt_order a, b;
    lb_prompt_order_init(&a, 5, tr.n);
    lb_prompt_order_init(&b, 5, tr.n);
    int seen[90] = {0}, moved = 0;
    for (int i = 0; i < 90; i++) seen[lb_prompt_order_at(&a, (uint64_t)i)]++;
    for (int i = 0; i < 90; i++) ck_assert_int_eq(seen[i], 1);
    for (int i = 0; i < 90; i++)
        moved += lb_prompt_order_at(&a, (uint64_t)(90 + i)) != lb_prompt_order_at(&b, (uint64_t)i);
    ck_assert_int_gt(moved, 0);
    for (int i = 300; i >= 0; i -= 7)   // drawn in any order, the same prompts
        ck_assert_int_eq(lb_prompt_order_at(&a, (uint64_t)i), lb_prompt_order_at(&b, (uint64_t)i));
    lb_prompt_order_free(&a);
    lb_prompt_order_free(&b);
    free(tr.p), free(va.p);
    lb_prompts_free(&all);

    // the chat template
    char *t = lb_chat_apply("<|user|>\\n{prompt}<|assistant|>\\n", "2+2=", err, sizeof err);
    ck_assert_ptr_nonnull(t);
    ck_assert_str_eq(t, "<|user|>\n2+2=<|assistant|>\n");
    free(t);
    ck_assert_ptr_null(lb_chat_apply("Q: prompt", "x", err, sizeof err));
    ck_assert_msg(strstr(err, "holds no {prompt}"), "%s", err);
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    ck_assert(system(cmd) == 0);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("reward");
    TCase *tc = tcase_create("reward");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_answer_match);
    tcase_add_test(tc, test_builtin_rewards);
    tcase_add_test(tc, test_reward_command_batches);
    tcase_add_test(tc, test_reward_command_timeout);
    tcase_add_test(tc, test_reward_command_failures);
    tcase_add_test(tc, test_prompt_sets);
    suite_add_tcase(s, tc);
    return lb_test_run(s);
}
