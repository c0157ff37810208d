// Chat rendering: the C++ renderers against Python jinja2 renderings of the
// real template strings (tests/data/chat_template_reference.json, recorded by
// tests/data/record_chat_template_reference.py from tests/data/chat_templates),
// template recognition, refusals and APPEND continuations.
#include "common/tokenizer/chat_template.h"

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "common/status_macros.h"
#include "gtest/gtest.h"
#include "tests/common/gguf/reference_data.h"
#include "tests/common/tokenizer/llamacpp_vocab.h"

namespace kvcache {
namespace tok {
namespace {

TEST(ChatTemplateTest, PlainChatMl) {
  const ChatTemplate t = ChatTemplate::ChatMl();
  auto s = t.Render({{"user", "Hi"}, {"assistant", "Hello"}}, true);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(*s,
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_EQ(*t.Render({{"user", "Hi"}}, false), "<|im_start|>user\nHi<|im_end|>\n");
}

TEST(ChatTemplateTest, DefaultSystemPromptOnlyWithoutSystemMessage) {
  auto t = ChatTemplate::FromTemplateText(
      "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
      "{{ '<|im_start|>system\\nBe nice, it\\'s kind<|im_end|>\\n' }}{% endif %}"
      "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
      "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->default_system_prompt(), "Be nice, it's kind");
  EXPECT_EQ(*t->Render({{"user", "Q"}}, false),
            "<|im_start|>system\nBe nice, it's kind<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n");
  EXPECT_EQ(*t->Render({{"system", "S"}, {"user", "Q"}}, false),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n");
}

TEST(ChatTemplateTest, UnknownTemplateAndBadInput) {
  auto t = ChatTemplate::FromTemplateText(
      "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(t.status().message().find("raw text"), std::string::npos);
  const ChatTemplate c = ChatTemplate::ChatMl();
  EXPECT_EQ(c.Render({}, true).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.Render({{"user\n<|im_start|>system", "x"}}, true).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The family each recorded template must be recognised as.
const std::map<std::string, ChatTemplate::Kind>& ExpectedKinds() {
  using K = ChatTemplate::Kind;
  static const auto* kinds = new std::map<std::string, K>{
      {"smollm2", K::kChatMl},       {"qwen2-vocab", K::kChatMl},
      {"qwen2.5", K::kChatMl},       {"qwen3", K::kQwen3},
      {"llama-3", K::kLlama3},       {"llama-3-llamacpp-test", K::kLlama3},
      {"llama-3.1", K::kLlama31},    {"llama-3.2", K::kLlama31},
      {"mistral-v0", K::kMistralV0}, {"mistral-v1", K::kMistralV1},
      {"mistral-v3", K::kMistralV3}, {"mistral-v3-tekken", K::kMistralV3Tekken},
      {"mistral-v7", K::kMistralV7},
  };
  return *kinds;
}

std::vector<ChatMessage> Messages(const google::protobuf::Value& conversation) {
  std::vector<ChatMessage> out;
  for (const auto& m : conversation.struct_value().fields().at("messages").list_value().values()) {
    out.push_back({m.struct_value().fields().at("role").string_value(),
                   m.struct_value().fields().at("content").string_value()});
  }
  return out;
}

// The template of one entry of chat_template_reference.json's "templates",
// read from tests/data/chat_templates with the entry's BOS and EOS texts.
absl::StatusOr<ChatTemplate> RecordedTemplate(
    const google::protobuf::Map<std::string, google::protobuf::Value>& t) {
  auto jinja = testing::ReadFileBytes(testing::SourceDir() + "/tests/data/chat_templates/" +
                                      t.at("file").string_value());
  if (!jinja.ok()) return jinja.status();
  return ChatTemplate::FromTemplateText(*jinja, t.at("bos_token").string_value(),
                                        t.at("eos_token").string_value());
}

TEST(ChatTemplateJinjaTest, RendersAsJinja2OnRealTemplates) {
  auto ref = testing::LoadReference("chat_template_reference.json");
  ASSERT_TRUE(ref.ok()) << ref.status();
  const auto& conversations = ref->fields().at("conversations").list_value().values();
  const auto& templates = ref->fields().at("templates").list_value().values();
  ASSERT_EQ(templates.size(), ExpectedKinds().size());
  for (const auto& tv : templates) {
    const auto& t = tv.struct_value().fields();
    const std::string name = t.at("name").string_value();
    auto tmpl = RecordedTemplate(t);
    ASSERT_TRUE(tmpl.ok()) << name << ": " << tmpl.status();
    ASSERT_EQ(ExpectedKinds().count(name), 1u) << name;
    EXPECT_EQ(tmpl->kind(), ExpectedKinds().at(name)) << name;
    int rendered = 0, refused = 0;
    for (const auto& cv : t.at("cases").list_value().values()) {
      const auto& c = cv.struct_value().fields();
      const auto& conversation = conversations[static_cast<int>(c.at("conversation").number_value())];
      const std::string label = name + " / " +
                                conversation.struct_value().fields().at("name").string_value() +
                                (c.at("add_generation_prompt").bool_value() ? " (generation prompt)" : "");
      auto got = tmpl->Render(Messages(conversation), c.at("add_generation_prompt").bool_value());
      if (c.count("error") > 0) {
        // The Jinja raised: the request is malformed for this model.
        EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << label;
        ++refused;
      } else {
        ASSERT_TRUE(got.ok()) << label << ": " << got.status();
        EXPECT_EQ(*got, c.at("text").string_value()) << label;
        ++rendered;
      }
    }
    printf("%-22s %-36s %2d renderings match jinja2, %2d refusals match\n", name.c_str(),
           ChatTemplate::KindName(tmpl->kind()), rendered, refused);
  }
}

// A conversation [user, assistant, rest...] rendered whole equals the text up
// to the assistant turn's end-of-turn token followed by RenderAppend(rest):
// what an APPEND request adds to a session is what a full render would hold.
TEST(ChatTemplateJinjaTest, AppendContinuesTheJinjaRendering) {
  auto ref = testing::LoadReference("chat_template_reference.json");
  ASSERT_TRUE(ref.ok()) << ref.status();
  const auto& conversations = ref->fields().at("conversations").list_value().values();
  int checked = 0;
  for (const auto& tv : ref->fields().at("templates").list_value().values()) {
    const auto& t = tv.struct_value().fields();
    const std::string name = t.at("name").string_value();
    if (name == "qwen3") continue;  // rewrites earlier assistant turns; tested below
    auto tmpl = RecordedTemplate(t);
    ASSERT_TRUE(tmpl.ok()) << name << ": " << tmpl.status();
    const std::string eot = tmpl->kind() == ChatTemplate::Kind::kChatMl    ? "<|im_end|>"
                            : tmpl->kind() == ChatTemplate::Kind::kLlama3  ? "<|eot_id|>"
                            : tmpl->kind() == ChatTemplate::Kind::kLlama31 ? "<|eot_id|>"
                                                                           : t.at("eos_token").string_value();
    for (const auto& cv : t.at("cases").list_value().values()) {
      const auto& c = cv.struct_value().fields();
      if (c.count("error") > 0) continue;
      const std::vector<ChatMessage> all =
          Messages(conversations[static_cast<int>(c.at("conversation").number_value())]);
      if (all.size() < 3 || all[0].role != "user" || all[1].role != "assistant") continue;
      // The cut below looks for the assistant text itself: skip texts that
      // are empty or that a template trims.
      if (all[1].content.empty() || all[1].content.front() == ' ' || all[1].content.back() == ' ') continue;
      const std::string& full = c.at("text").string_value();
      const size_t cut = full.find(all[1].content + eot);
      ASSERT_NE(cut, std::string::npos) << name;
      const std::vector<ChatMessage> rest(all.begin() + 2, all.end());
      auto tail = tmpl->RenderAppend(rest, c.at("add_generation_prompt").bool_value());
      ASSERT_TRUE(tail.ok()) << name << ": " << tail.status();
      EXPECT_EQ(full.substr(cut + all[1].content.size() + eot.size()), *tail) << name;
      ++checked;
    }
  }
  EXPECT_GE(checked, 20);
}

// The rendered text at each content span.
std::vector<std::string> SpanTexts(const std::string& text, const ContentSpans& spans) {
  std::vector<std::string> out;
  for (const auto& [b, e] : spans) out.push_back(text.substr(b, e - b));
  return out;
}

TEST(ChatTemplateTest, ContentSpansCoverOnlyMessageContent) {
  const ChatTemplate t = ChatTemplate::ChatMl();
  ContentSpans spans = {{7, 7}};  // replaced, not appended to
  auto s = t.Render({{"system", "S"}, {"user", "<|im_end|>x"}, {"assistant", ""}}, true, &spans);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(spans, (ContentSpans{{19, 20}, {48, 59}}));  // an empty content has no span
  EXPECT_EQ(SpanTexts(*s, spans), (std::vector<std::string>{"S", "<|im_end|>x"}));

  auto tail = t.RenderAppend({{"user", "Q"}}, true, &spans);
  ASSERT_TRUE(tail.ok());
  EXPECT_EQ(*tail, "\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(spans, (ContentSpans{{18, 19}}));

  // Llama 3.1: trimmed content, the system content after the fixed header.
  auto llama =
      testing::ReadFileBytes(testing::SourceDir() + "/tests/data/chat_templates/llama-3.1-8b-instruct.jinja");
  ASSERT_TRUE(llama.ok());
  auto l31 = ChatTemplate::FromTemplateText(*llama, "<|begin_of_text|>", "<|eot_id|>");
  ASSERT_TRUE(l31.ok());
  s = l31->Render({{"system", " Sys "}, {"user", "\n<|eot_id|> U\n"}}, true, &spans);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(SpanTexts(*s, spans), (std::vector<std::string>{"Sys", "<|eot_id|> U"}));

  // Qwen3: the reasoning and the answer of the last assistant turn, not the
  // <think> markup the template writes around them.
  auto qwen3 = ChatTemplate::FromTemplateText(
      "{%- set ns = namespace(last_query_index=0) %}<think><|im_start|><|im_end|>");
  ASSERT_TRUE(qwen3.ok());
  s = qwen3->Render({{"user", "Q"}, {"assistant", "<think>\nR\n</think>\n\nA"}}, false, &spans);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(*s,
            "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\nR\n</think>\n\nA<|im_end|>\n");
  EXPECT_EQ(SpanTexts(*s, spans), (std::vector<std::string>{"Q", "R", "A"}));

  // An error leaves no spans.
  EXPECT_FALSE(t.Render({}, true, &spans).ok());
  EXPECT_TRUE(spans.empty());
}

// On every recorded real template: the spans are ascending, disjoint, inside
// the text; each holds text from a message's content; every place a message's
// content (a distinctive marker) lands is inside a span; and the text is the
// one Render gives without spans.
TEST(ChatTemplateJinjaTest, ContentSpansOnRealTemplates) {
  auto ref = testing::LoadReference("chat_template_reference.json");
  ASSERT_TRUE(ref.ok()) << ref.status();
  const std::vector<std::vector<ChatMessage>> conversations = {
      {{"user", " marker-u1 "}},
      {{"system", "marker-s0\n"}, {"user", "marker-u1"}, {"assistant", " marker-a2 "}, {"user", "marker-u3"}},
      {{"user", "marker-u1"},
       {"assistant", "<think>\nmarker-r2\n</think>\n\nmarker-a2"},
       {"user", "marker-u3"}},
      {{"system", "marker-s0"}, {"user", "marker-u1"}},
  };
  int checked = 0;
  for (const auto& tv : ref->fields().at("templates").list_value().values()) {
    const auto& t = tv.struct_value().fields();
    const std::string name = t.at("name").string_value();
    auto tmpl = RecordedTemplate(t);
    ASSERT_TRUE(tmpl.ok()) << name << ": " << tmpl.status();
    for (const auto& messages : conversations) {
      for (bool append : {false, true}) {
        ContentSpans spans;
        auto text =
            append ? tmpl->RenderAppend(messages, true, &spans) : tmpl->Render(messages, true, &spans);
        if (!text.ok()) continue;  // refused by this template
        EXPECT_EQ(*text, *(append ? tmpl->RenderAppend(messages, true) : tmpl->Render(messages, true)));
        const std::string label = name + (append ? " (append) " : " ") + messages[0].content;
        size_t prev_end = 0;
        for (const auto& [b, e] : spans) {
          EXPECT_LE(prev_end, b) << label;
          EXPECT_LT(b, e) << label;
          EXPECT_LE(e, text->size()) << label;
          prev_end = e;
          const std::string piece = text->substr(b, std::min(e, text->size()) - b);
          bool from_content = false;
          for (const ChatMessage& m : messages) from_content |= m.content.find(piece) != std::string::npos;
          EXPECT_TRUE(from_content) << label << ": '" << piece << "'";
        }
        for (size_t at = text->find("marker-"); at != std::string::npos; at = text->find("marker-", at + 1)) {
          bool inside = false;
          for (const auto& [b, e] : spans) inside |= b <= at && at + 9 <= e;
          EXPECT_TRUE(inside) << label << ": marker at " << at << " in '" << *text << "'";
        }
        ++checked;
      }
    }
  }
  EXPECT_GE(checked, 60);
}

// Reasoning templates written in ChatML's tokens, from llama.cpp's
// models/templates: their prompts are not ChatML's (QwQ's generation prompt ends
// '<think>\n', SmolLM3 writes a metadata system block), so they are refused,
// not rendered as ChatML; Qwen 2.5's and Qwen 3's are still recognised.
TEST(ChatTemplateTest, ReasoningTemplatesInChatMlTokensAreNotTakenForChatMl) {
  auto kind_of = [](const std::string& file) -> absl::StatusOr<ChatTemplate::Kind> {
    const std::string path = testing::LlamaCppSourceDir() + "/models/templates/" + file;
    auto jinja = testing::ReadFileBytes(path);
    if (!jinja.ok())
      return absl::Status(jinja.status().code(),
                          std::string(jinja.status().message()) + testing::kLlamaCppVocabHint);
    KVCACHE_ASSIGN_OR_RETURN(ChatTemplate t, ChatTemplate::FromTemplateText(*jinja));
    return t.kind();
  };
  for (const char* file :
       {"Qwen-QwQ-32B.jinja", "Bielik-11B-v3.0-Instruct.jinja", "HuggingFaceTB-SmolLM3-3B.jinja",
        "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja", "LFM2.5-8B-A1B.jinja"}) {
    auto kind = kind_of(file);
    ASSERT_NE(kind.status().code(), absl::StatusCode::kNotFound) << kind.status();
    EXPECT_EQ(kind.status().code(), absl::StatusCode::kFailedPrecondition) << file;
  }
  auto qwen25 = kind_of("Qwen-Qwen2.5-7B-Instruct.jinja");
  ASSERT_TRUE(qwen25.ok()) << qwen25.status();
  EXPECT_EQ(*qwen25, ChatTemplate::Kind::kChatMl);
  auto qwen3 = kind_of("Qwen-Qwen3-0.6B.jinja");
  ASSERT_TRUE(qwen3.ok()) << qwen3.status();
  EXPECT_EQ(*qwen3, ChatTemplate::Kind::kQwen3);
}

TEST(ChatTemplateTest, AppendContinuations) {
  // ChatML: after the <|im_end|> the session holds, a newline, then the turns;
  // no default system prompt.
  auto smol = ChatTemplate::FromTemplateText(
      "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
      "{{ '<|im_start|>system\\nBe nice<|im_end|>\\n' }}{% endif %}"
      "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
      "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}");
  ASSERT_TRUE(smol.ok());
  EXPECT_EQ(*smol->RenderAppend({{"user", "Q"}}, true),
            "\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n");
  // Qwen3 keeps the turn shape.
  auto qwen3 = ChatTemplate::FromTemplateText(
      "{%- set ns = namespace(last_query_index=0) %}<think><|im_start|><|im_end|>");
  ASSERT_TRUE(qwen3.ok());
  EXPECT_EQ(qwen3->kind(), ChatTemplate::Kind::kQwen3);
  EXPECT_EQ(*qwen3->RenderAppend({{"user", "Q"}}, true),
            "\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n");
  // Mistral: an APPEND that breaks the alternation is refused.
  auto v0 = ChatTemplate::FromTemplateText(
      "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == "
      "0) %}"
      "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif "
      "%}"
      "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
      "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
      "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor "
      "%}",
      "<s>", "</s>");
  ASSERT_TRUE(v0.ok()) << v0.status();
  EXPECT_EQ(v0->kind(), ChatTemplate::Kind::kMistralV0);
  EXPECT_EQ(*v0->RenderAppend({{"user", "Q"}}, true), "[INST] Q [/INST]");
  EXPECT_EQ(v0->RenderAppend({{"assistant", "A"}}, true).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(v0->Render({{"system", "S"}, {"user", "Q"}}, true).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Roles beyond system/user/assistant: only ChatML and Llama 3 write them.
  EXPECT_EQ(v0->Render({{"tool", "x"}}, true).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(qwen3->Render({{"tool", "x"}}, true).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tok
}  // namespace kvcache
