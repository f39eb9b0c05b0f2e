// unicode.cpp: character classes (a table for the Basic Multilingual Plane built once
// from ICU, ICU itself above it) and NFC through ICU's UTF-8 normalizer.
#include "data/unicode.h"

#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>

#include <array>
#include <memory>

#include "engine/error.h"

namespace mhar::data {
namespace {

CharClass classify_with_icu(char32_t c) {
  if (u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_WHITE_SPACE)) return CharClass::Space;
  switch (u_charType(static_cast<UChar32>(c))) {
    case U_UPPERCASE_LETTER:
    case U_LOWERCASE_LETTER:
    case U_TITLECASE_LETTER:
    case U_MODIFIER_LETTER:
    case U_OTHER_LETTER:
      return CharClass::Letter;
    case U_DECIMAL_DIGIT_NUMBER:
    case U_LETTER_NUMBER:
    case U_OTHER_NUMBER:
      return CharClass::Number;
    default:
      return CharClass::Other;
  }
}

// Most text is in the BMP, where a table lookup is several times cheaper than ICU.
const std::array<CharClass, 0x10000>& bmp_table() {
  static const auto table = [] {
    auto t = std::make_unique<std::array<CharClass, 0x10000>>();
    for (char32_t c = 0; c < 0x10000; ++c) (*t)[c] = classify_with_icu(c);
    return t;
  }();
  return *table;
}

}  // namespace

CharClass char_class(char32_t c) {
  if (c < 0x10000) return bmp_table()[c];
  if (c == kInvalidByte) return CharClass::Other;
  return classify_with_icu(c);
}

bool may_need_nfc(std::string_view text) {
  // U+0300 is encoded as CC 80; every lead byte >= 0xCC starts a code point >= U+0300.
  for (unsigned char b : text)
    if (b >= 0xCC) return true;
  return false;
}

std::string nfc(std::string_view text) {
  if (!may_need_nfc(text)) return std::string(text);
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* normalizer = icu::Normalizer2::getNFCInstance(status);
  if (U_FAILURE(status)) fail("ICU: cannot load the NFC normalizer: ", u_errorName(status));
  std::string out;
  out.reserve(text.size());
  size_t run_start = 0;
  auto flush = [&](size_t end) {
    if (end <= run_start) return;
    std::string_view run = text.substr(run_start, end - run_start);
    if (!may_need_nfc(run)) {
      out.append(run);
      return;
    }
    icu::StringByteSink<std::string> sink(&out);
    normalizer->normalizeUTF8(0, icu::StringPiece(run.data(), static_cast<int32_t>(run.size())),
                              sink, nullptr, status);
    if (U_FAILURE(status)) fail("ICU: NFC normalization failed: ", u_errorName(status));
  };
  for (size_t i = 0; i < text.size();) {
    const DecodedChar ch = decode_utf8(text, i);
    if (ch.code == kInvalidByte) {
      flush(i);
      out.push_back(text[i]);
      run_start = i + 1;
    }
    i += ch.length;
  }
  flush(text.size());
  return out;
}

}  // namespace mhar::data
