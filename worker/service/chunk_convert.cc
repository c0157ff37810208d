#include "worker/service/chunk_convert.h"

#include "absl/strings/str_cat.h"
#include "worker/kv/session_key.h"

namespace kvcache::service {
namespace {

v1::KvShape ShapeToWire(const kv::KvShape& s) {
  v1::KvShape w;
  w.set_layers(s.layers);
  w.set_kv_heads(s.kv_heads);
  w.set_head_dim(s.head_dim);
  w.set_dtype(kv::DtypeName(s.dtype));
  w.set_page_tokens(s.page_tokens);
  w.set_sliding_window(s.sliding_window);
  return w;
}

absl::StatusOr<kv::KvShape> ShapeFromWire(const v1::KvShape& w) {
  kv::KvShape s;
  s.layers = w.layers();
  s.kv_heads = w.kv_heads();
  s.head_dim = w.head_dim();
  s.page_tokens = w.page_tokens();
  s.sliding_window = w.sliding_window();
  if (w.dtype() == "f32") {
    s.dtype = kv::KvDtype::kF32;
  } else if (w.dtype() == "f16") {
    s.dtype = kv::KvDtype::kF16;
  } else if (w.dtype() == "bf16") {
    s.dtype = kv::KvDtype::kBF16;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown KV dtype '", w.dtype(), "'"));
  }
  absl::Status st = kv::ValidateShape(s);
  if (!st.ok()) return st;
  return s;
}

}  // namespace

v1::SessionChunk ToWire(const kv::KvChunk& c, int32_t index, const std::vector<int32_t>& context) {
  v1::SessionChunk w;
  w.set_index(index);
  switch (c.kind) {
    case kv::KvChunk::Kind::kBegin: {
      auto* b = w.mutable_begin();
      b->set_session_id(kv::SplitSessionKey(c.session_id).id);  // the wire carries (tenant, id)
      b->set_tenant(c.tenant);
      b->set_model_id(c.model_id);
      *b->mutable_kv_shape() = ShapeToWire(c.shape);
      break;
    }
    case kv::KvChunk::Kind::kTokens: {
      auto* t = w.mutable_tokens();
      t->set_token_offset(c.token_offset);
      t->mutable_token_ids()->Add(c.token_ids.begin(), c.token_ids.end());
      break;
    }
    case kv::KvChunk::Kind::kPages: {
      auto* p = w.mutable_pages();
      for (const kv::PageSegment& s : c.segments) {
        auto* ws = p->add_segments();
        ws->set_page_index(s.page_index);
        ws->set_offset(s.offset);
        ws->set_length(s.length);
        ws->set_page_checksum(s.page_checksum);
      }
      p->set_payload(c.payload.data(), c.payload.size());
      break;
    }
    case kv::KvChunk::Kind::kCommit: {
      auto* m = w.mutable_commit();
      m->set_num_tokens(c.num_tokens);
      m->set_first_live_page(c.first_live_page);
      m->mutable_page_checksums()->Add(c.page_checksums.begin(), c.page_checksums.end());
      m->mutable_context_tokens()->Add(context.begin(), context.end());
      break;
    }
  }
  return w;
}

absl::StatusOr<kv::KvChunk> FromWire(const v1::SessionChunk& w, std::vector<int32_t>* context) {
  kv::KvChunk c;
  switch (w.kind_case()) {
    case v1::SessionChunk::kBegin: {
      c.kind = kv::KvChunk::Kind::kBegin;
      c.session_id = kv::SessionKey(w.begin().tenant(), w.begin().session_id());
      c.tenant = w.begin().tenant();
      c.model_id = w.begin().model_id();
      auto shape = ShapeFromWire(w.begin().kv_shape());
      if (!shape.ok()) return shape.status();
      c.shape = *shape;
      break;
    }
    case v1::SessionChunk::kTokens:
      c.kind = kv::KvChunk::Kind::kTokens;
      if (w.tokens().token_offset() < 0) return absl::InvalidArgumentError("negative token offset");
      c.token_offset = w.tokens().token_offset();
      c.token_ids.assign(w.tokens().token_ids().begin(), w.tokens().token_ids().end());
      break;
    case v1::SessionChunk::kPages: {
      c.kind = kv::KvChunk::Kind::kPages;
      int64_t total = 0;
      for (const auto& s : w.pages().segments()) {
        if (s.page_index() < 0 || s.offset() < 0 || s.length() <= 0 || s.length() > kv::kMaxChunkWireBytes) {
          return absl::InvalidArgumentError("page segment with a negative or oversized field");
        }
        total += s.length();
        c.segments.push_back(kv::PageSegment{s.page_index(), s.offset(), s.length(), s.page_checksum()});
      }
      if (total != static_cast<int64_t>(w.pages().payload().size())) {
        return absl::InvalidArgumentError(absl::StrCat(
            "page segments describe ", total, " bytes but the payload has ", w.pages().payload().size()));
      }
      c.payload.assign(w.pages().payload().begin(), w.pages().payload().end());
      break;
    }
    case v1::SessionChunk::kCommit:
      c.kind = kv::KvChunk::Kind::kCommit;
      if (w.commit().num_tokens() < 0 || w.commit().first_live_page() < 0) {
        return absl::InvalidArgumentError("negative commit field");
      }
      c.num_tokens = w.commit().num_tokens();
      c.first_live_page = w.commit().first_live_page();
      c.page_checksums.assign(w.commit().page_checksums().begin(), w.commit().page_checksums().end());
      if (context != nullptr) {
        context->assign(w.commit().context_tokens().begin(), w.commit().context_tokens().end());
      }
      break;
    case v1::SessionChunk::KIND_NOT_SET:
      return absl::InvalidArgumentError("session chunk without a kind");
  }
  return c;
}

}  // namespace kvcache::service
